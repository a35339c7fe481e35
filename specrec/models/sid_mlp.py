"""The distilled drafter: SID-MLP-style per-level heads over the target's first decoder position.

Level 0 is the target's own: the drafter reads the GR decoder's state at BOS,
``h0`` (one decoder position, the root of every prefix tree), and level 0's
distribution is the target's output layer on it, so the first level is exact.
Each later level ``j`` is a small residual MLP over ``h0`` and the prefix's
codes::

    x_j = A_j h0 + sum_{i<j} E_j[i, c_i]
    x_j = x_j + FF_j(LN(x_j))                      (``blocks`` times)
    q_j(. | c_<j) = softmax(W_j LN(x_j) + b_j)

It is distilled from the target (:mod:`specrec.train.distill`): KL(p || q) at
the prefixes the target's own beam search keeps at every level, so the
drafter's beams hold the target's frontier, which is what one tree pass needs
to verify a whole beam search (``strict``). Its beam search is a few small
matrix products per level and runs inside the same graph as that tree pass
(``strict``'s graph, :mod:`specrec.decoding.searches.strict`).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field
from torch import nn


class SidMlpConfig(BaseModel):
    hidden: int = Field(default=256, ge=8, le=4096, description="width of each level's residual stream")
    ff: int = Field(default=512, ge=8, le=8192, description="inner width of each feed-forward block")
    blocks: int = Field(default=1, ge=1, le=8, description="residual feed-forward blocks per level")


class _Block(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ff)
        self.fc2 = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class _Level(nn.Module):
    offsets: torch.Tensor

    def __init__(self, d_model: int, j: int, vmax: int, v: int, cfg: SidMlpConfig):
        """Level ``j`` (its prefix has j codes, each below ``vmax``: a dead beam's code may be any of them)."""
        super().__init__()
        d = cfg.hidden
        self.ctx = nn.Linear(d_model, d)
        self.emb = nn.Embedding(j * vmax, d)
        self.register_buffer("offsets", torch.arange(j, dtype=torch.int64) * vmax, persistent=False)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.blocks = nn.ModuleList(_Block(d, cfg.ff) for _ in range(cfg.blocks))
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, v)

    def forward(self, h0: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """h0 [R, d_model], prefix [R, M, j] -> logits [R, M, V_j]."""
        x = self.ctx(h0).unsqueeze(1) + self.emb(prefix + self.offsets).sum(2)
        for b in self.blocks:
            x = b(x)
        return self.out(self.ln(x))


class SidMlpDrafter(nn.Module):
    """Levels 1..L-1 of a SID given the target's BOS state (level 0 is the target's own)."""

    def __init__(self, level_sizes: list[int], d_model: int, cfg: SidMlpConfig | None = None):
        super().__init__()
        self.cfg = cfg or SidMlpConfig()
        self.level_sizes = list(level_sizes)
        self.L = len(level_sizes)
        vmax = max(self.level_sizes)
        self.levels = nn.ModuleList(_Level(d_model, j, vmax, self.level_sizes[j], self.cfg) for j in range(1, self.L))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def level_logprobs(self, h0: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """Level ``j = prefix.shape[-1]`` (>= 1) after each prefix [R, M, j] -> log-probs [R, M, V_j]."""
        j = prefix.shape[-1]
        return torch.log_softmax(self.levels[j - 1](h0, prefix).float(), dim=-1)
