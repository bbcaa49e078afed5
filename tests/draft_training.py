"""Train a tiny DFlash draft against a tiny target, so engine tests see real acceptance.

The recipe is the product trainer's (dflash_engine.train), scaled down to a CPU test budget:
- training sequences are the target's own greedy continuations of random short prompts;
- random anchors `a` on response tokens; block input `[x_a, MASK x (B-1)]` embedded with the
  frozen target embedding at absolute positions a..a+B-1;
- the block attends to the context strictly before the anchor (positions < a, K/V from
  ctx = hidden_norm(fc(concat taps)) through each layer's k_proj/k_norm/RoPE and v_proj,
  no input_layernorm) and bidirectionally within its own block;
- row k (k >= 1) predicts x_{a+k} through the frozen target lm_head, loss weight
  exp(-(k-1)/gamma); the draft starts from a random initialisation.

The trainer is the product's (dflash_engine.train: dense training forward from the
draft module's own parameters, taps from a dense forward of the engine's target, export in
the published DFlashDraftModel layout that `load_draft` reads); this module only supplies the
test data (random byte prompts continued greedily by the target) and the test recipe.

Which target: `make_learnable_target` writes a tiny Qwen3 whose greedy continuations a
one-layer draft can learn in seconds. A large rms_norm_eps with small weights keeps the
layers' contribution to the residual stream small, so the target's greedy decoding is
mostly a fixed random map of the current token with some dependence on context: it falls
into cycles of varied periods (not just repeats). Rows of a block then need different
tokens (RoPE matters) and the draft learns to read its context (context bugs show).
`make_learnable_hybrid_target` is the same trick on a tiny Qwen3.5 (tests/tiny_hybrid.py:
Gated DeltaNet + gated attention layers); the product trainer takes its taps from the
engine's own hybrid forward (dflash_engine.train.taps).

`measure_acceptance` replays greedy speculative decoding with the real inference path
(paged target + KVCache + draft.write_context/forward), without the engine.

Typical use from other tests:
    target = make_learnable_target(tmp / "target")
    draft = train_tiny_draft(target, tmp / "draft", cache_dir=tmp_path_factory.getbasetemp() / "drafts")
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from attention_meta import meta_for_batch
from tiny_models import (
    ENDOFTEXT_ID,
    SPECIAL_TOKENS,
    make_tiny_qwen3,
    make_tiny_tokenizer,
)
from torch import Tensor

import dflash_engine.train as product
from dflash_engine.models.qwen3_5_config import is_hybrid_config
from dflash_engine.train import Sample, TrainConfig, loss_gamma  # noqa: F401 (re-exported)
from dflash_engine.train.dense import dense_block_forward  # noqa: F401 (re-exported)

FIRST_RESERVED_ID = ENDOFTEXT_ID + len(SPECIAL_TOKENS)  # ids >= this are reserved (unused) tokens
# make_tiny_qwen3 arguments of a target whose greedy continuations are learnable (see above).
LEARNABLE_TARGET: dict[str, Any] = {"initializer_range": 0.05, "rms_norm_eps": 1.0, "seed": 1}
TRAIN_PROMPT_SEED = 0  # prompts of training seed s are random_prompts(..., seed=s); hold out others


# make_tiny_qwen3_5 arguments of the hybrid twin. Its layers (random zero-centred norms, GDN)
# move the residual stream less than Qwen3's at the same init: a larger init_range gives the
# same profile as LEARNABLE_TARGET (greedy next token a fixed function of the current one ~93%
# of the time; 256 random prompts end in ~60 different cycles). At 0.05 it is ~99.5% (a
# handful of cycles: nothing to read from the context); at 0.2, ~56% (too hard for one layer).
LEARNABLE_HYBRID_TARGET: dict[str, Any] = {"initializer_range": 0.12, "rms_norm_eps": 1.0, "seed": 1}
HYBRID_VOCAB = 300  # tests/tiny_hybrid.py TINY_TEXT
# Training steps of the trained hybrid pair (tests/test_hybrid_engine.py, tests/test_tensor_parallel.py:
# the same value in both, so the second one takes the first's draft from the session's cache).
# 800 steps: τ 2.66 on test_hybrid_engine's 32 held-out prompts (1200 steps: 2.72, ~3 s more training).
HYBRID_DRAFT_STEPS = 800


def make_learnable_target(path: str | Path, **overrides: Any) -> Path:
    return make_tiny_qwen3(path, **{**LEARNABLE_TARGET, **overrides})


def make_learnable_hybrid_target(path: str | Path, **overrides: Any) -> Path:
    """A Qwen3_5ForCausalLM directory (with the byte tokenizer) of learnable greedy continuations."""
    from tiny_hybrid import make_tiny_qwen3_5

    path, _ = make_tiny_qwen3_5(path, **{**LEARNABLE_HYBRID_TARGET, **overrides})
    make_tiny_tokenizer(path, HYBRID_VOCAB)
    return path


# --------------------------------------------------------------------------- data


def random_prompts(num: int, length: int, seed: int, vocab: int = 256) -> Tensor:
    """[num, length] random byte tokens (ids < 256: ordinary text bytes)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen)


@torch.no_grad()
def generate_training_data(
    target_dir: str | Path, prompts: Tensor, new_tokens: int, tap_layers: Sequence[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Greedy continuations of `prompts` by the target (Hugging Face transformers, float32).
    EOS does not stop them: every continuation is exactly `new_tokens` long.

    Returns (tokens [N, P+new], taps [N, P+new, n_taps*H], target embedding [V, H],
    lm_head weight [V, H] or None when tied). taps[:, p] concatenates the residual stream
    after each decoder layer in `tap_layers`, taken with forward hooks: Hugging Face's
    hidden_states[L+1] is that too except for the last layer, where transformers returns the
    final-normed output instead."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None  # no early stop
    seqs = model.generate(
        prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    assert seqs.shape == (prompts.shape[0], prompts.shape[1] + new_tokens), seqs.shape

    captured: dict[int, Tensor] = {}
    layers = model.model.layers

    def hook(i: int):
        return lambda _mod, _inp, out: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(tap_layers))]
    try:
        model(input_ids=seqs, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    taps = torch.cat([captured[i] for i in tap_layers], dim=-1)
    embed = model.get_input_embeddings().weight.detach().clone()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    lm_head = None if tied else model.get_output_embeddings().weight.detach().clone()
    return seqs, taps, embed, lm_head


def pick_mask_token(tokens: Tensor, vocab_size: int) -> int:
    """The reserved id (never produced by the tokenizer) that the target's continuations use
    least (ideally never); ties go to the highest id (the product's rule over these ids)."""
    if vocab_size <= FIRST_RESERVED_ID:
        raise ValueError(f"vocab_size {vocab_size} has no reserved ids to use as the mask token")
    return product.pick_mask_token(range(FIRST_RESERVED_ID, vocab_size), tokens.tolist(), vocab_size)[0]


# --------------------------------------------------------------------------- train + save


def default_train_layer_ids(num_target_layers: int) -> list[int]:
    """A low layer and the last one (which carries most next-token information)."""
    return sorted({num_target_layers // 4, num_target_layers - 1})


@dataclass
class TrainReport:
    seconds: float = 0.0  # data generation + training (not saving)
    data_seconds: float = 0.0
    steps: int = 0
    first_loss: float = float("nan")
    final_loss: float = float("nan")
    mask_token_id: int = -1
    mask_token_count: int = -1  # occurrences of the mask id in the training continuations
    target_layer_ids: list[int] = field(default_factory=list)
    num_sequences: int = 0
    seq_len: int = 0
    from_cache: bool = False


class _torch_state:
    """Seeds torch's global RNG and fixes the intra-op thread count for the duration (both
    restored afterwards). One thread: the same bits on any machine, and on a busy 2-core box
    it is several times faster than oversubscribed threads."""

    def __init__(self, seed: int, num_threads: int):
        self.seed, self.num_threads = seed, num_threads

    def __enter__(self):
        self.saved_rng, self.saved_threads = torch.random.get_rng_state(), torch.get_num_threads()
        torch.manual_seed(self.seed)
        torch.set_num_threads(self.num_threads)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.saved_rng)
        torch.set_num_threads(self.saved_threads)


def _cache_key(target_dir: Path, params: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    recipe = sorted(Path(product.__file__).parent.glob("*.py"))  # the product trainer's package
    target_cfg = json.loads((target_dir / "config.json").read_text())
    if is_hybrid_config(target_cfg):
        # A hybrid target's taps are the engine's own forward (dflash_engine.train.taps): its
        # models and ops sources are part of the recipe too.
        engine = Path(product.__file__).parent.parent
        recipe += sorted((engine / "models").glob("*.py")) + sorted((engine / "ops").glob("*.py"))
    for f in [Path(__file__), Path(__file__).with_name("tiny_models.py"), *recipe,
              target_dir / "config.json", *sorted(target_dir.glob("*.safetensors"))]:
        h.update(f.read_bytes())  # the recipe's source and the target's weights
    return h.hexdigest()[:24]


def train_tiny_draft(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    block_size: int = 4,
    num_layers: int = 1,
    steps: int = 1200,
    seed: int = 0,
    target_layer_ids: Sequence[int] | None = None,
    num_prompts: int = 1024,
    prompt_len: int = 8,
    new_tokens: int = 48,
    lr: float = 1e-2,
    seqs_per_step: int = 16,
    anchors_per_step: int = 8,
    cache_dir: str | Path | None = None,
    num_threads: int = 1,
    report: TrainReport | None = None,
) -> Path:
    """Train a DFlash draft for the target in `target_dir` and save it to `out_dir`
    (config.json, model.safetensors, tokenizer files, train_report.json). Returns out_dir.

    Data: `num_prompts` random byte prompts of `prompt_len` (random_prompts(seed=seed)),
    continued greedily by the target for `new_tokens`. Each step: `seqs_per_step` sequences x
    `anchors_per_step` random anchors per sequence on response tokens, Adam at `lr` (20-step
    warm-up, cosine decay, no clipping), through the product trainer (dflash_engine.train.train).
    Taps default to default_train_layer_ids; mask_token_id is the reserved id least used by
    the continuations. Deterministic for given arguments and target.

    With `cache_dir`, a draft trained earlier with the same target weights, arguments and
    recipe source is copied from there; a freshly trained one is stored there."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    layer_ids = (list(target_layer_ids) if target_layer_ids is not None
                 else default_train_layer_ids(target_cfg["num_hidden_layers"]))
    params = {
        "block_size": block_size, "num_layers": num_layers, "steps": steps, "seed": seed,
        "target_layer_ids": layer_ids, "num_prompts": num_prompts, "prompt_len": prompt_len,
        "new_tokens": new_tokens, "lr": lr, "seqs_per_step": seqs_per_step,
        "anchors_per_step": anchors_per_step,
    }
    rep = report if report is not None else TrainReport()

    cached = None
    if cache_dir is not None:
        cached = Path(cache_dir) / f"draft-{_cache_key(target_dir, params)}"
        if (cached / "train_report.json").is_file():  # written last: the entry is complete
            rep.__dict__.update(json.loads((cached / "train_report.json").read_text()))
            rep.from_cache = True
            if cached.resolve() != out_dir.resolve():
                shutil.copytree(cached, out_dir, dirs_exist_ok=True)
            return out_dir

    t0 = time.perf_counter()
    with _torch_state(seed, num_threads):
        _train(target_dir, target_cfg, layer_ids, rep, out_dir, **params)
    rep.seconds = time.perf_counter() - t0
    (out_dir / "train_report.json").write_text(json.dumps(asdict(rep), indent=2))

    if cached is not None and cached.resolve() != out_dir.resolve():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-draft-", dir=cached.parent))
        shutil.copytree(out_dir, tmp, dirs_exist_ok=True)
        try:
            os.replace(tmp, cached)  # atomic publish (a concurrent writer may have won)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _train(target_dir: Path, target_cfg: dict[str, Any], layer_ids: list[int], rep: TrainReport,
           out_dir: Path, *, block_size: int, num_layers: int, steps: int, seed: int,
           target_layer_ids: list[int], num_prompts: int, prompt_len: int, new_tokens: int, lr: float,
           seqs_per_step: int, anchors_per_step: int) -> None:
    b, vocab = block_size, target_cfg["vocab_size"]
    if new_tokens < b:
        raise ValueError(f"new_tokens ({new_tokens}) must be >= block_size ({b})")
    t0 = time.perf_counter()
    tokens, _, _, _ = generate_training_data(
        target_dir, random_prompts(num_prompts, prompt_len, seed), new_tokens, layer_ids)
    rep.data_seconds = time.perf_counter() - t0
    mask_id = pick_mask_token(tokens, vocab)
    samples = [Sample(t[:prompt_len], t[prompt_len:], "random") for t in tokens.tolist()]
    cfg = TrainConfig(num_layers=num_layers, block_size=b, steps=steps, batch_size=seqs_per_step,
                      anchors_per_seq=anchors_per_step, lr=lr, warmup_steps=20, weight_decay=0.0,
                      grad_clip=None, seed=seed, target_layer_ids=list(layer_ids), eval_every=0,
                      save_every=0, save_dtype="float32")
    res = product.train(target_dir, out_dir, samples, cfg, mask_token=(mask_id, int((tokens == mask_id).sum())),
                        device="cpu", progress=False, save_checkpoints=False, log=lambda *_: None)
    make_tiny_tokenizer(out_dir, vocab)
    rep.first_loss, rep.final_loss, rep.steps = res.first_loss, res.final_loss, res.steps
    rep.mask_token_id, rep.mask_token_count = res.mask_token_id, res.mask_token_count
    rep.target_layer_ids, rep.num_sequences, rep.seq_len = list(layer_ids), tokens.shape[0], tokens.shape[1]


# --------------------------------------------------------------------------- acceptance


@dataclass
class AcceptanceStats:
    accepted: list[int]  # accepted draft tokens of every speculative step (0..B-1)
    block_size: int

    @property
    def mean(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)

    @property
    def tau(self) -> float:  # DFLASH.md's acceptance length: a + 1 per step
        return self.mean + 1.0

    def histogram(self) -> list[int]:
        return [self.accepted.count(i) for i in range(self.block_size)]


@torch.no_grad()
def measure_acceptance(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = 48,
    page_size: int = 4,
    context_position_offset: int = 0,
    num_threads: int = 1,
) -> AcceptanceStats:
    """Greedy speculative decoding replayed with the real inference path, without the engine.

    The paged target (load_target + KVCache + attention_meta.meta_for_batch) makes the greedy
    continuation of every prompt (batched, one token per step) with the taps of every
    position. Then, per prompt, the speculative loop: the draft context holds exactly [0, committed); the draft runs
    [bonus, MASK x (B-1)] non-causally at positions committed..committed+B-1;
    d_k = argmax target.compute_logits(row k); accepted = the leading d_k equal to the
    target's own greedy tokens; the taps of the committed rows become draft context in the
    same step. Steps run while a whole block fits in the continuation.

    context_position_offset != 0 writes the context at wrong RoPE positions (negative control)."""
    from dflash_engine.models import load_draft, load_target
    from dflash_engine.worker.kv_cache import KVCache

    with _torch_state(0, num_threads):
        target = load_target(target_dir, dtype="float32")
        draft = load_draft(draft_dir, target.config, dtype="float32")
        cfg = draft.config
        b, tap_layers = cfg.block_size, cfg.target_layer_ids
        prompts = [[int(t) for t in p] for p in prompts]
        totals = [len(p) + new_tokens for p in prompts]
        pages = [-(-(t + b) // page_size) for t in totals]
        kv = KVCache.allocate(target.config, cfg, 1 + sum(pages), page_size, torch.float32)
        # scattered pages (each request's table runs backwards); page 0 is the null page
        tables, first = [], 1
        for n in pages:
            tables.append(list(range(first + n - 1, first - 1, -1)))
            first += n

        # The target's greedy continuations, all prompts batched (one row per request per
        # step after the prefill), keeping the taps of every position.
        tokens = [list(p) for p in prompts]
        tap_rows: list[list[Tensor]] = [[] for _ in prompts]
        q_lens = [len(p) for p in prompts]
        for _ in range(new_tokens):
            seq_lens = [len(t) for t in tokens]
            m, pos = meta_for_batch(q_lens, seq_lens, tables, page_size, True)
            ids = torch.tensor([x for t, q in zip(tokens, q_lens) for x in t[len(t) - q:]])
            hidden, taps = target(ids, pos, m, kv, tap_layers)
            last = torch.tensor(m.query_start_loc_cpu[1:]) - 1
            for r, tok in enumerate(target.compute_logits(hidden[last]).argmax(-1).tolist()):
                tap_rows[r].append(taps[m.query_start_loc_cpu[r]:m.query_start_loc_cpu[r + 1]])
                tokens[r].append(tok)
            q_lens = [1] * len(prompts)

        # The speculative replay, one request at a time, on the same KV pages.
        accepted: list[int] = []
        for r, prompt in enumerate(prompts):
            seq, total, table = tokens[r], totals[r], [tables[r]]
            ctx_taps = torch.cat(tap_rows[r])  # positions 0..total-2

            def write_context(start: int, end: int, table=table, ctx_taps=ctx_taps) -> None:
                """Draft context for positions [start, end), from the target's taps."""
                if end > start:
                    m, pos = meta_for_batch([end - start], [end], table, page_size, True)
                    draft.write_context(ctx_taps[start:end], pos + context_position_offset,
                                        m.slot_mapping, kv)

            committed = len(prompt)  # prefill: the prompt rows become context, bonus = seq[P]
            write_context(0, committed)
            while committed + b <= total:
                m, pos = meta_for_batch([b], [committed + b], table, page_size, False)
                ids = torch.tensor([seq[committed]] + [cfg.mask_token_id] * (b - 1))
                h = draft(target.embed(ids), pos, m, kv)
                drafted = target.compute_logits(h[1:]).argmax(-1).tolist()
                a = 0
                while a < b - 1 and drafted[a] == seq[committed + 1 + a]:
                    a += 1
                accepted.append(a)
                # commit bonus + a drafts; their taps become context in this same step
                write_context(committed, min(committed + a + 1, total - 1))
                committed += a + 1
    return AcceptanceStats(accepted, b)
