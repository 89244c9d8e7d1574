"""A small GPT-style language model and a synthetic data set, for the examples and benchmarks.

``GPT(size="demo")`` has about 0.8M parameters and trains fast on a CPU; ``size="bench"`` has
about 3.3M. The data are deterministic token sequences cut from a repeated random pattern with a
little noise, so the loss falls quickly and visibly. Everything is seeded; with
``torch.use_deterministic_algorithms(True)`` two runs are bitwise identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = ["GPT", "SIZES", "GPTConfig", "make_dataset", "make_loader"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    ctx: int = 32  # tokens per training sequence
    dim: int = 128
    layers: int = 4
    heads: int = 4
    dropout: float = 0.1
    batch_size: int = 16
    samples: int = 2048  # sequences in the synthetic data set
    period: int = 23  # length of the repeated pattern
    noise: float = 0.1  # fraction of tokens replaced by random ones


SIZES = {
    # ~0.8M parameters, tens of ms per step on one core
    "demo": GPTConfig(),
    # ~3.3M parameters, ~0.1-0.3 s per step on two cores
    "bench": GPTConfig(vocab=256, ctx=64, dim=256, layers=4, heads=8, batch_size=16),
    # for smoke tests
    "tiny": GPTConfig(vocab=32, ctx=16, dim=32, layers=2, heads=2, batch_size=8, samples=256),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.triu(torch.ones(cfg.ctx, cfg.ctx, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(L.LightningModule):
    """Decoder-only transformer trained with AdamW, a per-step OneCycle schedule and clipping.

    Args:
        size: a key of :data:`SIZES`.
        total_steps: optimizer steps the schedule spans (at least the ``max_steps`` trained, >= 4).
        lr: peak learning rate.
        clip: gradient norm clipping threshold.
    """

    def __init__(
        self, size: str = "demo", total_steps: int = 1000, lr: float = 3e-3, clip: float = 1.0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = cfg = SIZES[size]
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.ctx, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(x) + self.pos[: x.shape[1]])
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        loss = F.cross_entropy(self(x).reshape(-1, self.cfg.vocab), y.reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        self.clip_gradients(
            optimizer, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm"
        )

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt,
            max_lr=self.hparams.lr,
            total_steps=self.hparams.total_steps,
            pct_start=max(0.1, 3 / self.hparams.total_steps),  # a warm-up phase in short runs too
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def plain_step(model: GPT, opt: torch.optim.Optimizer, sched: Any, batch: torch.Tensor,
               per_mesh: bool = False) -> torch.Tensor:
    """One optimizer step of ``model`` in a plain PyTorch loop (no Trainer), as the benchmarks
    drive it: next-token loss, backward, clipping, the optimizer and scheduler steps.
    ``per_mesh``: clip the parameters of each device mesh apart, as torchtitan does under FSDP x
    tensor parallelism (``clip_grad_norm_`` cannot stack norms computed over two meshes)."""
    x, y = batch[:, :-1], batch[:, 1:]
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).reshape(-1, model.cfg.vocab), y.reshape(-1))
    loss.backward()
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():
        groups.setdefault(getattr(p, "device_mesh", None) if per_mesh else None, []).append(p)
    for params in groups.values():
        torch.nn.utils.clip_grad_norm_(params, model.hparams.clip)
    opt.step()
    sched.step()
    return loss


def make_dataset(size: str = "demo", seed: int = 0) -> torch.Tensor:
    """``samples`` sequences of ``ctx + 1`` tokens: windows of a repeated pattern, with noise."""
    cfg = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, cfg.vocab, (cfg.period,), generator=g)
    starts = torch.randint(0, cfg.period, (cfg.samples, 1), generator=g)
    data = pattern[(starts + torch.arange(cfg.ctx + 1)) % cfg.period]
    noisy = torch.rand(data.shape, generator=g) < cfg.noise
    return torch.where(noisy, torch.randint(0, cfg.vocab, data.shape, generator=g), data)


def make_loader(size: str = "demo", seed: int = 0) -> StatefulDataLoader:
    """A shuffling, resumable loader over :func:`make_dataset` (seeded by the global torch RNG)."""
    return StatefulDataLoader(
        make_dataset(size, seed), batch_size=SIZES[size].batch_size, shuffle=True
    )


if __name__ == "__main__":  # quick look: parameter counts per size
    for name in SIZES:
        print(f"{name}: {sum(p.numel() for p in GPT(name).parameters()) / 1e6:.2f}M parameters")
