"""SpecGR++ self-drafting head: the GR encoder's own state as a retriever.

User vector: a projection of the GR encoder's output (mean over the history
positions and the last position). Item vector: a projection of the sum of the
item's SID code embeddings (the GR's own, frozen), so a new item is
retrievable as soon as it has a SID. Trained contrastively (in-catalogue
softmax) with the GR frozen: no second model to serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from .tiger import EncoderState, Tiger


class SelfDraftConfig(BaseModel):
    d_out: int = 64
    temperature: float = 0.05


class SelfDraftHead(nn.Module):
    def __init__(self, gr: Tiger, cfg: SelfDraftConfig | None = None):
        super().__init__()
        self.cfg = cfg or SelfDraftConfig()
        d = gr.cfg.d_model
        self.user = nn.Sequential(nn.Linear(2 * d, d), nn.GELU(), nn.Linear(d, self.cfg.d_out))
        self.item = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, self.cfg.d_out))

    def user_vectors(self, enc: EncoderState) -> torch.Tensor:
        mem, mask = enc.memory, enc.mask  # [R, S, d], [R, 1, 1, S]
        if mem is None or mask is None:
            raise ValueError("the self-draft head reads the encoder memory: an encoder state from Tiger.encode")
        keep = mask[:, 0, 0, :].unsqueeze(-1).to(mem.dtype)
        mean = (mem * keep).sum(1) / keep.sum(1).clamp(min=1)
        return F.normalize(self.user(torch.cat([mean, mem[:, -1]], dim=-1)), dim=-1)

    def item_vectors(self, gr: Tiger, sids: torch.Tensor) -> torch.Tensor:
        """sids [N, L] -> [N, d_out] from the GR's code embeddings."""
        emb = gr.tok(sids + gr.offsets).sum(1)
        return F.normalize(self.item(emb), dim=-1)
