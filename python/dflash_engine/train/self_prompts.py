"""Prompts the target writes itself: its chat template up to a user message, continued by
the target at temperature ~1 and deduplicated; with leads (`CODE_LEADS`), code requests that
start the way a user would ask for code."""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..sampling_params import SamplingParams

_SENTINEL = "\u2063SENTINEL\u2063"


def user_turn_prefix(tokenizer) -> tuple[str, list[int]]:
    """(text of the chat template up to a user message's content, stop ids that end a user
    turn). The target continues the prefix to write a user message itself."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not show the user's message verbatim")
    prefix, suffix = text.split(_SENTINEL, 1)
    stops = set(tokenizer.eos_token_ids)
    end = suffix.strip().split()[0] if suffix.strip() else ""
    if end and len(ids := tokenizer.encode(end, add_special_tokens=False)) == 1:
        stops.add(ids[0])
    return prefix, sorted(stops)


def _normalise(text: str) -> str:
    return " ".join(text.split()).lower()


# Openings of the code requests the target writes itself (`self_written_prompts` with leads):
# the target continues each into a task of its own, the way a user would ask for code.
CODE_LEADS = [
    "Write a Python function that",
    "Write a Python function",
    "Implement a function in Python that",
    "Create a Python program that",
    "Write a function that takes",
    "Complete the following Python function.\n\n```python\ndef",  # (no trailing space: BPE
    "Complete the following Python function.\n\n```python\nfrom typing import List\n\n\ndef",  # joins it)
    "Fix the bug in this Python code:\n\n```python\n",
    "What does this Python code do?\n\n```python\n",
    "Write a Python class",
    "Given a list of",
    "Given a string",
]


def self_written_prompts(llm, n: int, seed: int, max_tokens: int = 64, temperature: float = 1.0,
                         rounds: int = 4, leads: Sequence[str] = ("",)) -> list[str]:
    """User turns the target writes itself (sampled under its chat template), deduplicated.
    With `leads`, each turn starts with one of them (in turn) and the target writes the rest."""
    if n <= 0:
        return []
    tok = llm.get_tokenizer()
    prefix, stops = user_turn_prefix(tok)
    lead_ids = [tok.encode(prefix + lead, add_special_tokens=False) for lead in leads]
    specials = [t for t in (tok.bos_token, tok.eos_token) if t]
    out: list[str] = []
    seen: set[str] = set()
    for r in range(rounds):
        want = math.ceil((n - len(out)) * 1.5) + 2
        which = [(r * want + i) % len(leads) for i in range(want)]
        room = [llm.engine.max_model_len - len(lead_ids[j]) for j in which]
        params = [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max(1, min(max_tokens, room[i])),
                                 stop_token_ids=stops, seed=seed * 1_000_003 + r * 100_003 + i)
                  for i in range(want)]
        outs = llm.generate([{"prompt_token_ids": lead_ids[j]} for j in which], params, use_tqdm=False)
        for o, j in zip(outs, which):
            body = o.outputs[0].text
            text = (leads[j] + body).strip()  # (the body is decoded in the lead's context)
            if leads[j] and leads[j].count("```") % 2 and text.count("```") % 2:
                text += "\n```"  # a code block the target left open
            key = _normalise(text)
            if len(key) < 8 or key in seen or any(s in text for s in specials):
                continue
            seen.add(key)
            out.append(text)
            if len(out) == n:
                return out
    return out

