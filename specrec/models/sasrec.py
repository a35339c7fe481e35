"""SASRec, the baseline a user would pick instead of a generative recommender.

Item-id embeddings -> a causal transformer over the history -> the state at
the last position scores every item by inner product with its (tied)
embedding. Trained with a full softmax over the catalogue (cross-entropy,
"SASRec+" style), which is stronger than the original sampled binary loss.
It sees the same histories as the GR model (the split's last ``max_history``
items) and is evaluated by the same code (``specrec eval --ranker sasrec``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn


class SASRecConfig(BaseModel):
    n_items: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 256
    dropout: float = Field(0.3, ge=0.0, lt=1.0)
    max_history: int = 20


class SASRec(nn.Module):
    def __init__(self, cfg: SASRecConfig):
        super().__init__()
        self.cfg = cfg
        self.item = nn.Embedding(cfg.n_items + 1, cfg.d_model, padding_idx=0)  # row 0: padding; item i -> row i + 1
        self.pos = nn.Embedding(cfg.max_history, cfg.d_model)
        nn.init.normal_(self.item.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        with torch.no_grad():
            self.item.weight[0].zero_()
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def sequence(self, items: torch.Tensor) -> torch.Tensor:
        """items [B, T] item indices, left-padded with -1 -> states [B, T, d] (position i sees <= i)."""
        b, t = items.shape
        keep = items >= 0
        x = self.item(items + 1) * self.cfg.d_model ** 0.5
        x = self.drop(x + self.pos(torch.arange(self.cfg.max_history - t, self.cfg.max_history, device=items.device)))
        idx = torch.arange(t, device=items.device)
        allowed = (idx.view(1, t, 1) >= idx.view(1, 1, t)) & keep.view(b, 1, t)
        allowed = allowed | (idx.view(1, t, 1) == idx.view(1, 1, t))
        mask = (~allowed).repeat_interleave(self.cfg.n_heads, dim=0)  # True = masked
        return self.ln(self.encoder(x, mask=mask))

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., n_items] logits over the catalogue."""
        return states @ self.item.weight[1:].T

    def loss(self, inp: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the next item after every position (targets -1: none)."""
        states = self.sequence(inp)
        m = tgt >= 0
        return F.cross_entropy(self.scores(states[m]), tgt[m])

    @torch.inference_mode()
    def rank(
        self, histories: torch.Tensor, k: int, ban: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """[B, H] histories (left-padded, -1) -> [B, k] best items; ``ban`` (rows, items): pairs never ranked."""
        self.eval()
        scores = self.scores(self.sequence(histories)[:, -1])
        if ban is not None:
            scores[ban[0], ban[1]] = float("-inf")
        return scores.topk(k, dim=-1).indices
