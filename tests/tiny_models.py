"""Write tiny Hugging Face checkpoints (Qwen3, Llama, DFlash draft) with tokenizers for tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_engine.models.config import draft_config_dict, write_draft_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode mapping (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def make_tiny_tokenizer(path: str | Path, vocab_size: int) -> None:
    """Byte-level tokenizer: ids 0..255 are bytes, then the ChatML specials, then reserved
    tokens padding the vocabulary to `vocab_size`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(SPECIAL_TOKENS))]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + reserved])
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<|im_end|>") == IM_END_ID
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": TINY_SHAPE["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))


def _perturb_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    # HF initialises norm weights to ones; random ones catch a skipped or misplaced norm.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def _save_hf(model, path: Path, vocab_size: int, seed: int) -> Path:
    _perturb_norms(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(str(path), safe_serialization=True)
    make_tiny_tokenizer(path, vocab_size)
    return path


def _token_ids() -> dict[str, Any]:
    return dict(eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID, bos_token_id=None)


def make_tiny_qwen3(
    path: str | Path,
    tie_word_embeddings: bool = False,
    vocab_size: int = 300,
    seed: int = 0,
    initializer_range: float = 0.15,
    **overrides: Any,
) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{
        **TINY_SHAPE, **_token_ids(),
        "vocab_size": vocab_size, "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": initializer_range, "rope_theta": 10000.0, **overrides,
    })
    torch.manual_seed(seed)
    return _save_hf(Qwen3ForCausalLM(cfg).float().eval(), Path(path), vocab_size, seed)


def make_tiny_llama(
    path: str | Path,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int = 300,
    seed: int = 0,
    initializer_range: float = 0.15,
    attention_bias: bool = False,
    **overrides: Any,
) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {} if rope_scaling is None else {"rope_scaling": rope_scaling}
    cfg = LlamaConfig(**{
        **TINY_SHAPE, **_token_ids(), **extra,
        "vocab_size": vocab_size, "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": initializer_range, "attention_bias": attention_bias,
        "rope_theta": 50000.0, **overrides,
    })
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    if attention_bias:
        with torch.no_grad():  # HF zero-initialises biases; make them matter
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, initializer_range)
    return _save_hf(model, Path(path), vocab_size, seed)


def _target_dict(target: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(target, dict):
        return target
    return json.loads((Path(target) / "config.json").read_text())


def draft_tensor_shapes(cfg: dict[str, Any], n_taps: int) -> dict[str, tuple[int, ...]]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    shapes = {"fc.weight": (h, n_taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    return shapes


def make_tiny_dflash_draft(
    path: str | Path,
    target_dir_or_config: str | Path | dict[str, Any],
    num_layers: int = 2,
    block_size: int = 8,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    rope_theta: float = 10000.0,
    block_size_in_dflash_config: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Published DFlash layout (models/config.py draft_config_dict, unvalidated: tests write
    drafts that do not fit their target on purpose), with its own rope_theta.
    target_layer_ids=None leaves them out of config.json (the parser's default applies, one
    tap per draft layer)."""
    target = _target_dict(target_dir_or_config)
    vocab_size = target["vocab_size"]
    cfg = draft_config_dict(target, num_layers=num_layers, block_size=block_size,
                            mask_token_id=vocab_size - 1 if mask_token_id is None else mask_token_id,
                            target_layer_ids=target_layer_ids, validate=False)
    cfg.update(rope_theta=rope_theta, rope_scaling=None)
    if target_layer_ids is None:
        del cfg["dflash_config"]["target_layer_ids"]
    if block_size_in_dflash_config:
        cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    cfg.update(extra_config or {})
    n_taps = len(target_layer_ids) if target_layer_ids is not None else num_layers
    if state_dict is None:
        gen = torch.Generator().manual_seed(seed)
        state_dict = {
            name: (1.0 + 0.2 * torch.randn(shape, generator=gen)) if "norm" in name
            else 0.15 * torch.randn(shape, generator=gen)
            for name, shape in draft_tensor_shapes(cfg, n_taps).items()
        }
    path = Path(path)
    write_draft_config(path, cfg)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path / "model.safetensors"))
    make_tiny_tokenizer(path, vocab_size)
    return path


class one_thread:
    """One intra-op thread for the duration: the trainer's bits are per thread count, and on a
    busy 2-core box the tiny GEMMs of oversubscribed threads run an order of magnitude slower."""

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)
