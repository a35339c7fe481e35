"""UniSRec-style retrieval model for the retrieval drafter.

Frozen text embeddings -> MoE adaptor (parametric whitening experts, UniSRec)
-> item vectors; a small causal transformer over the history's item vectors
(SASRec-like) -> a user vector; score = inner product. Because items enter
only through their text embedding, an item added after training is
retrievable as soon as its text is embedded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn


class RetrievalConfig(BaseModel):
    text_dim: int = 384
    d_model: int = 64
    n_experts: int = 4
    n_layers: int = 2
    n_heads: int = 2
    d_ff: int = 256
    dropout: float = 0.2
    max_history: int = 20
    temperature: float = 0.05


class MoEAdaptor(nn.Module):
    """UniSRec's adaptor: a softmax-gated mix of whitening experts (x - b_i) W_i."""

    def __init__(self, cfg: RetrievalConfig):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(cfg.n_experts, cfg.text_dim))
        self.experts = nn.Parameter(torch.randn(cfg.n_experts, cfg.text_dim, cfg.d_model) * cfg.text_dim**-0.5)
        self.gate = nn.Linear(cfg.text_dim, cfg.n_experts, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(x)
        e, d, k = self.experts.shape
        # (x - b_i) W_i = x W_i - b_i W_i: one [.., d] x [d, e*k] matmul instead of an [.., e, d] copy of x
        z = (x @ self.experts.permute(1, 0, 2).reshape(d, e * k)).unflatten(-1, (e, k))
        z = z - torch.einsum("ed,edk->ek", self.bias, self.experts)
        g = torch.softmax(self.gate(x), dim=-1).unsqueeze(-1)
        return (g * z).sum(-2)


class RetrievalModel(nn.Module):
    def __init__(self, cfg: RetrievalConfig):
        super().__init__()
        self.cfg = cfg
        self.adaptor = MoEAdaptor(cfg)
        self.pos = nn.Embedding(cfg.max_history, cfg.d_model)
        # item vectors are unit-norm (~0.12 per dimension): N(0, 1) positions would drown them
        nn.init.normal_(self.pos.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def item_vectors(self, text_emb: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.adaptor(text_emb), dim=-1)

    def sequence(self, hist_vec: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """hist_vec [B, T, d] (left-padded), keep [B, T] -> states at every position [B, T, d].
        Position i attends to real positions <= i (a padding position only to itself)."""
        b, t, _ = hist_vec.shape
        pos = torch.arange(self.cfg.max_history - t, self.cfg.max_history, device=hist_vec.device)
        x = self.drop(hist_vec + self.pos(pos))
        idx = torch.arange(t, device=x.device)
        allowed = (idx.view(1, t, 1) >= idx.view(1, 1, t)) & keep.view(b, 1, t)
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device).unsqueeze(0)
        mask = (~allowed).repeat_interleave(self.cfg.n_heads, dim=0)  # True = masked, [B*heads, T, T]
        x = self.encoder(x, mask=mask)
        return F.normalize(self.ln(x), dim=-1)

    def user_vectors(self, hist_text: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """hist_text [B, T, text_dim] left-padded; the state at the last position."""
        return self.sequence(self.item_vectors(hist_text), keep)[:, -1]
