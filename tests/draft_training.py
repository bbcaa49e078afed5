"""Train a tiny DFlash draft against a tiny target, so engine tests see real acceptance.

The recipe is the one of shared/design/DFLASH.md ("Training a draft"), scaled down to a
CPU test budget:
- training sequences are the target's own greedy continuations of random short prompts;
- random anchors `a` on response tokens; block input `[x_a, MASK x (B-1)]` embedded with the
  frozen target embedding at absolute positions a..a+B-1;
- the block attends to the context strictly before the anchor (positions < a, K/V from
  ctx = hidden_norm(fc(concat taps)) through each layer's k_proj/k_norm/RoPE and v_proj,
  no input_layernorm) and bidirectionally within its own block;
- row k (k >= 1) predicts x_{a+k} through the frozen target lm_head, loss weight
  exp(-(k-1)/gamma).

The training forward is written densely here from the draft module's own parameters (the
module's paged forward is the inference path); the result is saved in the published
DFlashDraftModel layout and loads with `load_draft`.

`measure_acceptance` replays greedy speculative decoding with the real inference path
(paged target + KVCache + draft.write_context/forward), without the engine.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from dflash_engine.models.config import DraftConfig
from dflash_engine.models.dflash import DFlashDraftModel
from dflash_engine.ops.rotary import rotate_half
from tiny_models import ENDOFTEXT_ID, SPECIAL_TOKENS, make_tiny_dflash_draft

FIRST_RESERVED_ID = ENDOFTEXT_ID + len(SPECIAL_TOKENS)  # ids >= this are reserved tokens
_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFLASH.md loss decay per block size
_RECIPE_VERSION = 1  # bump when the training recipe changes (invalidates caches)


def loss_gamma(block_size: int) -> float:
    return _GAMMA.get(block_size, max(1.0, block_size / 2))


# --------------------------------------------------------------------------- data


def random_prompts(num: int, length: int, seed: int, vocab: int = 256) -> Tensor:
    """[num, length] random byte tokens (ids < 256: ordinary text bytes)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen)


@torch.no_grad()
def generate_training_data(
    target_dir: str | Path, prompts: Tensor, new_tokens: int, tap_layers: Sequence[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Greedy continuations of `prompts` by the target (Hugging Face transformers, float32,
    no EOS stop: the continuation runs for exactly `new_tokens`).

    Returns (tokens [N, P+new], taps [N, P+new, n_taps*H] = hidden_states[L+1] concatenated,
    target embedding weight [V, H], lm_head weight [V, H] or None when tied)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = model(input_ids=prompts, use_cache=True)
    seqs = torch.cat([prompts, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    for _ in range(new_tokens - 1):
        out = model(input_ids=seqs[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        seqs = torch.cat([seqs, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    # Taps by forward hooks on the decoder layers: the residual stream after layer L. (HF's
    # hidden_states[L+1] is that too, except for the last layer, where transformers returns
    # the final-normed output instead.)
    captured: dict[int, Tensor] = {}
    layers = model.model.layers
    hooks = [
        layers[i].register_forward_hook(
            lambda _m, _inp, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in set(tap_layers)
    ]
    try:
        model(input_ids=seqs, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    taps = torch.cat([captured[layer] for layer in tap_layers], dim=-1)
    embed = model.get_input_embeddings().weight.detach().clone()
    lm_head = model.get_output_embeddings().weight.detach().clone()
    tied = lm_head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return seqs, taps.detach(), embed, None if tied else lm_head


def pick_mask_token(tokens: Tensor, vocab_size: int) -> int:
    """The reserved id (never produced by the tokenizer) least used by the target's
    continuations; ties go to the highest id."""
    if vocab_size <= FIRST_RESERVED_ID:
        raise ValueError(f"vocab_size {vocab_size} has no reserved ids to use as the mask token")
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size)[FIRST_RESERVED_ID:vocab_size]
    best = min(range(len(counts)), key=lambda i: (int(counts[i]), -i))
    return FIRST_RESERVED_ID + best


# --------------------------------------------------------------------------- training forward


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, T, heads, hd]; cos/sin [T, hd] (neox rotate-half, as ops.rotary.apply_rotary)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


def dense_block_forward(
    draft: DFlashDraftModel,
    taps: Tensor,
    block_embeds: Tensor,
    anchors: Tensor,
) -> Tensor:
    """Dense training forward of DFlash blocks, from the draft module's parameters.

    taps [N, S, n_taps*H] (context of every sequence at positions 0..S-1),
    block_embeds [N, A, B, H] (block input embeddings for the A anchors of each sequence),
    anchors [A] int64 (same anchors for every sequence; block row k sits at position a+k).
    Block of anchor a sees context positions < a and its own B rows (non-causal).
    Returns the final-normed hidden of the block rows [N, A, B, H]."""
    cfg = draft.config
    n, s, _ = taps.shape
    _, a_num, b, h = block_embeds.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    scale = hd**-0.5

    ctx = draft.hidden_norm(F.linear(taps, draft.fc.weight))  # [N, S, H]
    ctx_cos, ctx_sin = draft.rotary(torch.arange(s), ctx.dtype)  # [S, hd]
    blk_pos = (anchors[:, None] + torch.arange(b)[None, :]).flatten()  # [A*B]
    blk_cos, blk_sin = draft.rotary(blk_pos, ctx.dtype)
    # Keys are [context 0..S-1, every block row of every anchor]. Block row (a, k) sees the
    # context strictly before a and the B rows of its own block (non-causal).
    row_anchor = anchors.repeat_interleave(b)  # [A*B]
    row_block = torch.arange(a_num).repeat_interleave(b)  # [A*B]
    visible = torch.cat([
        torch.arange(s)[None, :] < row_anchor[:, None],  # [A*B, S]
        row_block[None, :] == row_block[:, None],  # [A*B, A*B]
    ], dim=1)

    def heads(t: Tensor, count: int) -> Tensor:  # [N, T, count*hd] -> [N, nh, T, hd] (GQA)
        t = t.view(n, -1, count, hd).transpose(1, 2)
        return t.repeat_interleave(nh // count, dim=1) if count != nh else t

    x = block_embeds.reshape(n, a_num * b, h)
    for layer in draft.layers:
        attn = layer.self_attn
        # context K/V straight from ctx: no input_layernorm
        kc = attn.k_norm(F.linear(ctx, attn.k_proj.weight).view(n, s, nkv, hd))
        kc = _rope(kc, ctx_cos, ctx_sin)
        vc = F.linear(ctx, attn.v_proj.weight)
        hn = layer.input_layernorm(x)
        q = attn.q_norm(F.linear(hn, attn.q_proj.weight).view(n, a_num * b, nh, hd))
        q = _rope(q, blk_cos, blk_sin)
        kb = attn.k_norm(F.linear(hn, attn.k_proj.weight).view(n, a_num * b, nkv, hd))
        kb = _rope(kb, blk_cos, blk_sin)
        vb = F.linear(hn, attn.v_proj.weight)
        k = heads(torch.cat([kc.flatten(2), kb.flatten(2)], dim=1), nkv)
        v = heads(torch.cat([vc, vb], dim=1), nkv)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible, scale=scale)
        x = x + F.linear(o.transpose(1, 2).reshape(n, a_num * b, nh * hd), attn.o_proj.weight)
        hn = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = x + F.linear(F.silu(F.linear(hn, mlp.gate_proj.weight)) * F.linear(hn, mlp.up_proj.weight),
                         mlp.down_proj.weight)
    return draft.norm(x).view(n, a_num, b, h)


# --------------------------------------------------------------------------- train + save


def draft_config_dict(
    target_cfg: dict[str, Any],
    *,
    block_size: int,
    num_layers: int,
    mask_token_id: int,
    target_layer_ids: Sequence[int],
) -> dict[str, Any]:
    """The published config.json, written by tiny_models.make_tiny_dflash_draft."""
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_dflash_draft(
            tmp, target_cfg, num_layers=num_layers, block_size=block_size,
            mask_token_id=mask_token_id, target_layer_ids=list(target_layer_ids),
            rope_theta=float(target_cfg.get("rope_theta", 10000.0)),
        )
        return json.loads((Path(tmp) / "config.json").read_text())


def default_train_layer_ids(num_target_layers: int) -> list[int]:
    """A low and the last target layer: the last one carries most next-token information."""
    return sorted({max(0, num_target_layers // 4), num_target_layers - 1})


@dataclass
class TrainReport:
    seconds: float = 0.0
    steps: int = 0
    first_loss: float = float("nan")
    final_loss: float = float("nan")
    mask_token_id: int = -1
    target_layer_ids: list[int] = field(default_factory=list)
    num_sequences: int = 0
    seq_len: int = 0


def _cache_key(target_dir: Path, params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({**params, "recipe": _RECIPE_VERSION}, sort_keys=True).encode())
    h.update((target_dir / "config.json").read_bytes())
    for f in sorted(target_dir.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def train_tiny_draft(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    block_size: int = 4,
    num_layers: int = 1,
    steps: int = 300,
    seed: int = 0,
    target_layer_ids: Sequence[int] | None = None,
    num_prompts: int = 64,
    prompt_len: int = 8,
    new_tokens: int = 48,
    lr: float = 3e-3,
    anchors_per_step: int | None = None,
    seqs_per_step: int | None = None,
    cache_dir: str | Path | None = None,
    num_threads: int = 1,
    report: TrainReport | None = None,
) -> Path:
    """Train a tiny DFlash draft for the target in `target_dir` and save it to `out_dir`
    (config.json, model.safetensors, tokenizer files). Deterministic for a given seed.

    With `cache_dir`, a draft already trained with the same target weights and arguments is
    copied from there instead of trained again (and a fresh one is stored there).
    Returns `out_dir` as a Path."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    n_target_layers = target_cfg["num_hidden_layers"]
    layer_ids = list(target_layer_ids) if target_layer_ids is not None else default_train_layer_ids(n_target_layers)
    params = dict(block_size=block_size, num_layers=num_layers, steps=steps, seed=seed,
                  target_layer_ids=layer_ids, num_prompts=num_prompts, prompt_len=prompt_len,
                  new_tokens=new_tokens, lr=lr, anchors_per_step=anchors_per_step,
                  seqs_per_step=seqs_per_step)
    cached = None
    if cache_dir is not None:
        cached = Path(cache_dir) / f"draft-{_cache_key(target_dir, params)}"
        if (cached / "model.safetensors").is_file() and (cached / "train_report.json").is_file():
            if report is not None:
                report.__dict__.update(json.loads((cached / "train_report.json").read_text()))
            if cached.resolve() != out_dir.resolve():
                shutil.copytree(cached, out_dir, dirs_exist_ok=True)
            return out_dir

    rep = report if report is not None else TrainReport()
    t0 = time.perf_counter()
    with _torch_state(seed, num_threads):
        state_dict, cfg_dict, rep = _train(
            target_dir, target_cfg, layer_ids, block_size, num_layers, steps, seed,
            num_prompts, prompt_len, new_tokens, lr, anchors_per_step, seqs_per_step, rep,
        )
    rep.seconds = time.perf_counter() - t0

    _save(out_dir, target_cfg, cfg_dict, state_dict, rep)
    if cached is not None and cached.resolve() != out_dir.resolve():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".draft-tmp-", dir=cached.parent))
        shutil.copytree(out_dir, tmp, dirs_exist_ok=True)
        try:
            os.replace(tmp, cached)  # atomic publish; a concurrent winner is fine too
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


class _torch_state:
    """Seed torch's global RNG and fix the intra-op thread count for the duration (both
    restored afterwards). One thread: bit-identical results on any machine, and on a busy
    2-core box it is several times faster than oversubscribed threads."""

    def __init__(self, seed: int, num_threads: int):
        self.seed, self.num_threads = seed, num_threads

    def __enter__(self):
        self.saved = torch.random.get_rng_state()
        self.saved_threads = torch.get_num_threads()
        torch.manual_seed(self.seed)
        torch.set_num_threads(self.num_threads)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.saved)
        torch.set_num_threads(self.saved_threads)


def _train(target_dir, target_cfg, layer_ids, block_size, num_layers, steps, seed,
           num_prompts, prompt_len, new_tokens, lr, anchors_per_step, seqs_per_step, rep: TrainReport):
    b = block_size
    if new_tokens < b:
        raise ValueError(f"new_tokens ({new_tokens}) must be >= block_size ({b})")
    prompts = random_prompts(num_prompts, prompt_len, seed)
    tokens, taps, embed, lm_head = generate_training_data(target_dir, prompts, new_tokens, layer_ids)
    vocab = target_cfg["vocab_size"]
    mask_id = pick_mask_token(tokens, vocab)
    cfg_dict = draft_config_dict(target_cfg, block_size=b, num_layers=num_layers,
                                 mask_token_id=mask_id, target_layer_ids=layer_ids)
    cfg = DraftConfig.from_dict(cfg_dict)

    gen = torch.Generator().manual_seed(seed + 1)
    draft = DFlashDraftModel(cfg).float()
    with torch.no_grad():  # deterministic random init (small, HF-like)
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    draft.train()

    lm_w = embed if lm_head is None else lm_head
    n, s = tokens.shape
    # anchors on response tokens: a in [prompt_len, S-B] (block rows stay inside the sequence)
    all_anchors = torch.arange(prompt_len, s - b + 1)
    weights = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / loss_gamma(b))  # row k=1..B-1
    weights = weights / weights.sum()
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / max(steps, 1)))
    )
    first = last = float("nan")
    for step in range(steps):
        if anchors_per_step is not None and anchors_per_step < len(all_anchors):
            pick = torch.randperm(len(all_anchors), generator=gen)[:anchors_per_step].sort().values
            anchors = all_anchors[pick]
        else:
            anchors = all_anchors
        if seqs_per_step is not None and seqs_per_step < n:
            rows = torch.randperm(n, generator=gen)[:seqs_per_step]
        else:
            rows = torch.arange(n)
        idx = anchors[:, None] + torch.arange(b)[None, :]  # [A, B]
        block_ids = tokens[rows][:, idx]  # [n_rows, A, B]
        labels = block_ids[:, :, 1:].clone()
        block_ids[:, :, 1:] = mask_id
        hidden = dense_block_forward(draft, taps[rows], F.embedding(block_ids, embed), anchors)
        logits = F.linear(hidden[:, :, 1:], lm_w)  # [N, A, B-1, V]
        ce = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
        loss = (ce.view(len(rows), len(anchors), b - 1) * weights).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        last = float(loss.detach())
        if step == 0:
            first = last
    rep.steps, rep.first_loss, rep.final_loss = steps, first, last
    rep.mask_token_id, rep.target_layer_ids = mask_id, list(layer_ids)
    rep.num_sequences, rep.seq_len = n, s
    state_dict = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    return state_dict, cfg_dict, rep


def _save(out_dir: Path, target_cfg, cfg_dict, state_dict, rep: TrainReport) -> None:
    make_tiny_dflash_draft(
        out_dir, target_cfg,
        num_layers=cfg_dict["num_hidden_layers"], block_size=cfg_dict["block_size"],
        mask_token_id=cfg_dict["dflash_config"]["mask_token_id"],
        target_layer_ids=cfg_dict["dflash_config"]["target_layer_ids"],
        state_dict=state_dict, rope_theta=cfg_dict["rope_theta"],
    )
    written = json.loads((out_dir / "config.json").read_text())
    assert written == cfg_dict, "config.json differs from the config trained with"
    (out_dir / "train_report.json").write_text(json.dumps(rep.__dict__, indent=2))


# --------------------------------------------------------------------------- acceptance


@dataclass
class AcceptanceStats:
    accepted: list[int]  # accepted draft tokens per block (0..B-1)
    block_size: int

    @property
    def mean(self) -> float:
        return sum(self.accepted) / max(len(self.accepted), 1)

    @property
    def tau(self) -> float:
        return self.mean + 1.0

    def histogram(self) -> list[int]:
        return [self.accepted.count(i) for i in range(self.block_size)]


@torch.no_grad()
def measure_acceptance(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = 40,
    page_size: int = 4,
) -> AcceptanceStats:
    """Greedy speculative decoding replayed with the real inference path, no engine.

    Per prompt: the paged target produces its greedy continuation and the taps of every
    position (one token per step). Then the speculative loop: the draft context holds exactly
    [0, committed); the draft runs [bonus, MASK x (B-1)] non-causally at committed..committed+B-1;
    d_k = argmax target.compute_logits(row k); accepted = leading d_k equal to the target's
    greedy tokens; the committed rows' taps are written as draft context in the same step."""
    from dflash_engine.kv_cache import KVCache
    from dflash_engine.models import load_draft, load_target
    from dflash_engine.ops import AttentionMetadata

    target = load_target(target_dir, dtype="float32")
    draft = load_draft(draft_dir, target.config, dtype="float32")
    dcfg = draft.config
    b, taps_ids = dcfg.block_size, dcfg.target_layer_ids
    accepted: list[int] = []
    for prompt in prompts:
        total = len(prompt) + new_tokens
        pages = -(-(total + b) // page_size)
        kv = KVCache.allocate(target.config, dcfg, pages + 1, page_size, torch.float32)
        table = [list(range(pages, 0, -1))]  # scattered (reversed) pages, page 0 is null

        def meta_for(q_len, seq_len, causal):
            return AttentionMetadata.for_batch([q_len], [seq_len], table, page_size, causal)

        # target greedy continuation with taps for every position
        tokens = list(prompt)
        meta, pos = meta_for(len(prompt), len(prompt), True)
        hidden, taps = target(torch.tensor(tokens), pos, meta, kv, taps_ids)
        all_taps = [taps]
        tokens.append(int(target.compute_logits(hidden[-1:]).argmax(-1)))
        while len(tokens) < total:
            meta, pos = meta_for(1, len(tokens), True)
            hidden, taps = target(torch.tensor(tokens[-1:]), pos, meta, kv, taps_ids)
            all_taps.append(taps)
            tokens.append(int(target.compute_logits(hidden).argmax(-1)))
        all_taps_t = torch.cat(all_taps)  # [total-1, n_taps*H]: taps of positions 0..total-2

        # speculative replay: the draft context is written for exactly the committed rows
        committed, written = len(prompt), 0

        def write_ctx(upto):
            nonlocal written
            if upto <= written:
                return
            meta, pos = meta_for(upto - written, upto, True)
            draft.write_context(all_taps_t[written:upto], pos, meta.slot_mapping, kv)
            written = upto

        write_ctx(committed)
        while committed + b - 1 < total:
            bonus = tokens[committed]
            meta, pos = meta_for(b, committed + b, False)
            ids = torch.tensor([bonus] + [dcfg.mask_token_id] * (b - 1))
            h = draft(target.embed(ids), pos, meta, kv)
            d = target.compute_logits(h[1:]).argmax(-1).tolist()
            a = 0
            while a < b - 1 and d[a] == tokens[committed + 1 + a]:
                a += 1
            accepted.append(a)
            committed += a + 1
            write_ctx(min(committed, total - 1))
    return AcceptanceStats(accepted, b)
