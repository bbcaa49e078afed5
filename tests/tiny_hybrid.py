"""Tiny Qwen3.5 hybrid checkpoints (transformers' own classes) and a miniature hybrid runner for tests."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from attention_meta import meta_for_batch

from dflash_engine.models.hybrid_state import HybridState, StateMetadata

LIN, FULL = "linear_attention", "full_attention"
TINY_TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=[LIN, FULL, LIN, LIN], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    eos_token_id=258, pad_token_id=256,
)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   num_position_embeddings=16)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers initialises norms to identity and dt_bias to ones: random values catch a
    skipped, misplaced or mis-centred norm and a wrong decay formula."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # plain weight
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # zero-centred: the scale is 1 + weight
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=gen).log())


def make_tiny_qwen3_5(path: str | Path, seed: int = 0, **overrides: Any):
    """A Qwen3_5ForCausalLM directory; returns (path, the transformers model, float32, eval)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY_TEXT, **overrides})).float().eval()
    _randomize(model, seed + 1)
    model.save_pretrained(str(path))
    return Path(path), model


def make_tiny_hybrid_draft(path: str | Path, target_dir: str | Path, block_size: int = 4) -> Path:
    """An untrained one-layer DFlash draft over the tiny hybrid target's layers 1 and 2, with
    the tiny tokenizer (the target's directory needs one too: tiny_models.make_tiny_tokenizer)."""
    import json

    from safetensors.torch import save_file
    from tiny_models import draft_tensor_shapes, make_tiny_tokenizer

    from dflash_engine.models.config import draft_config_dict, write_draft_config
    from dflash_engine.models.qwen3_5_config import HybridConfig

    hc = HybridConfig.from_dict(json.loads((Path(target_dir) / "config.json").read_text()))
    cfg = draft_config_dict(hc, num_layers=1, block_size=block_size, mask_token_id=299, target_layer_ids=[1, 2])
    cfg.update(rope_scaling=None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_draft_config(path, cfg)
    gen = torch.Generator().manual_seed(0)
    save_file({n: (1.0 + 0.2 * torch.randn(s, generator=gen)) if "norm" in n else 0.15 * torch.randn(s, generator=gen)
               for n, s in draft_tensor_shapes(cfg, 2).items()}, str(path / "model.safetensors"))
    make_tiny_tokenizer(path, hc.vocab_size)
    return path


def make_tiny_qwen3_5_vl(path: str | Path, text_model) -> Path:
    """A Qwen3_5ForConditionalGeneration directory (vision tower + language model) whose
    language model carries `text_model`'s weights."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(text_config=text_model.config.to_dict(), vision_config=TINY_VISION,
                        tie_word_embeddings=text_model.config.tie_word_embeddings)
    model = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.save_pretrained(str(path))
    return Path(path)


class HybridRequests:
    """Requests of a hybrid target: paged KV for its attention layers (scattered pages) and
    `slots_per_request` state slots each; `current[r]` is c[r], the slot of its committed
    state (-1: none yet). A miniature model runner."""

    def __init__(self, cfg, num_requests: int, max_len: int, slots_per_request: int = 1, page_size: int = 4,
                 seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32):
        pages_per = math.ceil(max_len / page_size)
        num_pages = 1 + num_requests * pages_per
        n_attn = len(cfg.attention_layer_ids)
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        kw = dict(dtype=dtype, device=device)
        self.kv = SimpleNamespace(target=[(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(n_attn)])
        perm = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
        self.tables = [perm[r * pages_per:(r + 1) * pages_per] for r in range(num_requests)]
        self.page_size = page_size
        # slot 0 unused: a request's slots are never the default-zero one by accident
        self.slots = [[1 + r * slots_per_request + i for i in range(slots_per_request)] for r in range(num_requests)]
        self.state = HybridState.allocate(cfg, 1 + num_requests * slots_per_request, dtype, device)
        self.device = device
        for pool in self.state.conv + self.state.recurrent:
            pool.fill_(float("nan"))  # recycled memory: a fresh request must never read it
        self.lens = [0] * num_requests
        self.current = [-1] * num_requests

    def run(self, model, chunks: list[list[int]], per_token: bool = False, tap_layers=None):
        """One forward over `chunks[r]` of each request. Plain: the state after a request's
        last row goes to its first slot (or stays in c[r]'s). per_token: row t keeps its
        state in the request's slot t (verification). Returns (logits, taps)."""
        q_lens = [len(c) for c in chunks]
        seq_lens = [n + q for n, q in zip(self.lens, q_lens)]
        meta, positions = meta_for_batch(q_lens, seq_lens, self.tables, self.page_size, True, self.device)
        qsl = meta.query_start_loc_cpu
        if per_token:
            write = [slot for r, q in enumerate(q_lens) for slot in self.slots[r][:q]]
            smeta = StateMetadata.from_lists(self.current, write, self.device)
        else:
            keep = [c if c >= 0 else self.slots[r][0] for r, c in enumerate(self.current)]
            smeta = StateMetadata.final(qsl, self.current, keep, self.device)
            self.current = keep
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        hidden, taps = model(ids, positions, meta, self.kv, tap_layers, state=self.state, state_meta=smeta)
        self.lens, self.last_q_lens = seq_lens, q_lens
        return model.compute_logits(hidden), taps

    def commit(self, r: int, accepted_rows: int) -> None:
        """After a per-token step: request r keeps the first `accepted_rows` rows of it; its
        committed state is the one after the last of them (an index update, no copy)."""
        self.lens[r] -= self.last_q_lens[r] - accepted_rows
        self.current[r] = self.slots[r][accepted_rows - 1]
