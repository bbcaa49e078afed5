"""The draft trainer: a randomly initialised draft with the target's layer shape, its AdamW
optimiser and warm-up + cosine schedule, the training step and the held-out acceptance
estimate, against a frozen target (the recipe of `dflash_engine.train`).

Row k (k >= 1) of the block of anchor `a` predicts x_{a+k} through the frozen target lm_head
(same-position labels), loss weight exp(-(k-1)/gamma); bf16 autocast on the GPU, float32 on
the CPU.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.config import DraftConfig
from ..models.packed import to_checkpoint_state_dict
from .batches import Batches
from .dense import dense_block_forward
from .taps import target_taps

_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def loss_gamma(block_size: int) -> float:
    """The published recipe's position decay: 7 for B=16, 5 for B=10, 4 for B=8; B/2 otherwise."""
    return _GAMMA.get(block_size, max(1.0, block_size / 2))


@dataclass
class TrainConfig:
    num_layers: int = 5  # the published recipe's depth (0.5B target)
    block_size: int = 16
    steps: int = 4000
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 32  # random anchors per sequence per step (the published recipe: up to 512)
    lr: float = 6e-4
    warmup_steps: int | None = None  # default: 2% of steps (at least 1)
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    seed: int = 0
    target_layer_ids: list[int] | None = None  # default: models/config.py default_target_layer_ids
    gamma: float | None = None  # default: loss_gamma(block_size)
    eval_every: int = 200  # held-out acceptance estimate (0: only at the end)
    eval_anchors: int = 16  # per held-out sequence
    eval_samples: int = 512  # held-out sequences scored (the same ones in every run: lowest hashes)
    save_every: int = 500  # checkpoints (0: only at the end)
    save_dtype: str = "bfloat16"  # of the exported weights (the engine casts to the target's dtype)
    # Target taps of every sample computed once and kept (on the training device) when they
    # fit in this many GiB, else recomputed by a target forward at every step.
    taps_cache_gib: float = 8.0
    # Wall-clock seconds for the training loop (None: no limit). After a short calibration
    # the run's total steps (and the cosine schedule with them) are fitted to the budget.
    time_budget_s: float | None = None


@dataclass
class TrainResult:
    steps: int = 0
    resumed_from: int = 0
    first_loss: float = float("nan")
    final_loss: float = float("nan")
    losses: list[float] = field(default_factory=list)  # every step of this run
    held_out_tau: float = float("nan")
    held_out_history: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    mask_token_id: int = -1
    mask_token_count: int = -1
    target_layer_ids: list[int] = field(default_factory=list)
    num_train: int = 0
    num_held_out: int = 0


def init_draft(draft, generator: torch.Generator) -> None:
    """Random initialisation: norms at one, matrices N(0, 1/fan_in)."""
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(torch.ones(p.shape))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))


class DraftTrainer:
    """A draft, its optimiser and schedule, trained against a frozen target."""

    def __init__(self, target, draft_cfg: dict[str, Any], cfg: TrainConfig, device: torch.device):
        from ..models.dflash import DFlashDraftModel  # (the engine's layers: imported when training)

        self.target, self.cfg, self.device = target, cfg, device
        self.draft_cfg = draft_cfg
        self.draft = DFlashDraftModel(DraftConfig.from_dict(draft_cfg)).float().to(device)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        init_draft(self.draft, torch.Generator().manual_seed(cfg.seed + 1))
        self.draft.train()
        self.autocast = device.type == "cuda"  # bf16 autocast on the GPU; float32 on the CPU
        embed = target.model.embed_tokens.weight  # frozen
        lm_w = embed if target.lm_head is None else target.lm_head.weight  # frozen
        self.embed, self.lm_w = (embed, lm_w) if self.autocast else (embed.float(), lm_w.float())
        self.mask_id = int(draft_cfg["dflash_config"]["mask_token_id"])
        self.tap_layers = list(draft_cfg["dflash_config"]["target_layer_ids"])
        b = cfg.block_size
        w = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / (cfg.gamma or loss_gamma(b)))  # k = 1..B-1
        self.pos_weights = (w / w.sum()).to(device)
        self.opt = torch.optim.AdamW(self.draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.total_steps = cfg.steps  # fitted to cfg.time_budget_s once the step time is known
        warm = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 50)

        def lr_lambda(i: int) -> float:
            steps = self.total_steps
            return min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / max(steps, 1)))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.step = 0

    def precompute_taps(self, batches: Batches, chunk: int = 64) -> int:
        """Keep the target taps of the leading samples of `batches` that fit the budget (all
        of them when they fit); returns how many. Batches of the others compute their taps."""
        width = len(self.tap_layers) * self.target.config.hidden_size
        dtype = torch.bfloat16 if self.autocast else torch.float32
        per_token = width * torch.finfo(dtype).bits // 8
        budget, count = self.cfg.taps_cache_gib * (1 << 30), 0
        for x in batches.seqs:
            budget -= len(x) * per_token
            if budget < 0:
                break
            count += 1
        if count == 0:
            return 0
        taps: list[Tensor] = []
        for start in range(0, count, chunk):
            rows = list(range(start, min(start + chunk, count)))
            ids, lens = batches.padded(rows)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                t = target_taps(self.target, ids, self.tap_layers).to(dtype)
            taps += [t[i, : lens[i]].clone() for i in range(len(rows))]
        batches.taps = taps
        return count

    def _blocks(self, ids: Tensor, anchors: Tensor, taps: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(hidden [N, A, B, H] of the blocks, labels [N, A, B-1])."""
        b = self.cfg.block_size
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            if taps is None:
                taps = target_taps(self.target, ids, self.tap_layers)
            idx = anchors[:, :, None] + torch.arange(b, device=ids.device)  # [N, A, B]
            block_ids = torch.gather(ids, 1, idx.flatten(1)).view_as(idx)
            labels = block_ids[:, :, 1:].clone()  # row k predicts x_{a+k} (same position)
            block_ids[:, :, 1:] = self.mask_id
            with torch.no_grad():
                embeds = F.embedding(block_ids, self.embed)
            if not self.autocast:
                taps = taps.float()
            hidden = dense_block_forward(self.draft, taps, embeds, anchors)
        return hidden, labels

    def loss(self, ids: Tensor, anchors: Tensor, weights: Tensor, taps: Tensor | None = None) -> Tensor:
        hidden, labels = self._blocks(ids, anchors, taps)
        n, a, b1 = labels.shape
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            logits = F.linear(hidden[:, :, 1:], self.lm_w)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        per_anchor = (ce.view(n, a, b1) * self.pos_weights).sum(-1)
        return (per_anchor * weights).sum() / weights.sum().clamp(min=1.0)

    def train_step(self, batches: Batches) -> tuple[float, int]:
        cfg = self.cfg
        n, m = len(batches), batches.num_cached
        lo, hi = 0, n
        if 0 < m < n:  # a batch of kept taps, or one that computes them, in proportion
            lo, hi = (0, m) if float(torch.rand(1, generator=self.gen)) < m / n else (m, n)
        rows = (lo + torch.randperm(hi - lo, generator=self.gen)[: min(cfg.batch_size, hi - lo)]).tolist()
        ids, anchors, weights, tokens = batches.make(rows, cfg.anchors_per_seq, self.gen)
        loss = self.loss(ids, anchors, weights, batches.batch_taps(rows))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.step += 1
        return float(loss.detach()), tokens

    @torch.no_grad()
    def held_out_tau(self, batches: Batches, batch_size: int = 8) -> float:
        """Teacher-forced acceptance on held-out sequences: per anchor, 1 + the number of
        leading block rows whose argmax equals the sequence's token (τ of greedy speculative
        decoding there, when the sequences are the target's greedy responses)."""
        if len(batches) == 0:
            return float("nan")
        was = self.draft.training
        self.draft.eval()
        gen = torch.Generator().manual_seed(12345)  # the same anchors at every evaluation
        total, count = 0.0, 0.0
        for start in range(0, len(batches), batch_size):
            rows = list(range(start, min(start + batch_size, len(batches))))
            ids, anchors, weights, _ = batches.make(rows, self.cfg.eval_anchors, gen)
            hidden, labels = self._blocks(ids, anchors, batches.batch_taps(rows))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                pred = F.linear(hidden[:, :, 1:], self.lm_w).argmax(-1)
            accepted = (pred == labels).long().cumprod(-1).sum(-1).float()
            total += float(((1.0 + accepted) * weights).sum())
            count += float(weights.sum())
        self.draft.train(was)
        return total / max(count, 1.0)

    # ---- checkpoints ----------------------------------------------------------------
    def state(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.step, "total_steps": self.total_steps, "draft": self.draft.state_dict(),
                "opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "gen": self.gen.get_state(),
                "train_config": asdict(self.cfg), "draft_config": self.draft_cfg, **extra}

    def load_state(self, ckpt: dict[str, Any]) -> None:
        self.draft.load_state_dict(ckpt["draft"])
        self.opt.load_state_dict(ckpt["opt"])
        self.sched.load_state_dict(ckpt["sched"])
        self.gen.set_state(ckpt["gen"])
        self.step = int(ckpt["step"])

    def checkpoint_state_dict(self, dtype: torch.dtype) -> dict[str, Tensor]:
        """Hugging Face names (q/k/v and gate/up split out of the packed parameters)."""
        sd = to_checkpoint_state_dict(self.draft.state_dict(), self.draft.config)
        return {k: v.detach().to("cpu", dtype).contiguous() for k, v in sd.items()}

