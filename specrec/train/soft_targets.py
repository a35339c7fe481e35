"""SASRec as a teacher for the GR model: its item distribution, marginalised onto each SID level.

For a training position with next item ``y`` whose codes are ``c_1 .. c_L``, the teacher's soft target at level
``l`` is the share of SASRec's probability mass, among the items whose codes start with ``c_1 .. c_{l-1}`` (the
true prefix, as the decoder is teacher-forced on it), that falls on each code of level ``l``. One SASRec pass over
the same causal chunk gives every position's distribution; the marginals are sums over the catalogue, so the
target costs a few [N, items] products per batch, small beside the GR's own pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.sasrec import SASRec


class SasrecTeacher:
    """Soft targets from a trained SASRec on the same catalogue (item index ``i`` = SID row ``i``)."""

    def __init__(self, sasrec: SASRec, sids: torch.Tensor, level_sizes: list[int], temperature: float = 1.0):
        if sasrec.cfg.n_items != len(sids):
            raise ValueError(f"the teacher scores {sasrec.cfg.n_items} items, the SIDs have {len(sids)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.max_history = sasrec.cfg.max_history  # its positions: a longer chunk than this it cannot read
        self.sasrec = sasrec.eval()
        for p in self.sasrec.parameters():
            p.requires_grad_(False)
        self.sids = sids
        self.level_sizes = list(level_sizes)
        self.temperature = temperature

    @torch.no_grad()
    def targets(self, inp: torch.Tensor, valid: torch.Tensor, tgt_codes: torch.Tensor) -> list[torch.Tensor]:
        """``inp`` [B, T] item indices (left-padded -1), ``valid`` [B, T] the positions taught, ``tgt_codes``
        [N, L] their targets' codes (row-major over ``valid``) -> per level a [N, V_l] distribution (rows whose
        true prefix the teacher gives no mass are all zero: no soft target there)."""
        with torch.autocast(inp.device.type, enabled=False):  # float32 whatever the student's training runs in
            states = self.sasrec.sequence(inp)[valid]  # [N, d]
            p = torch.softmax(self.sasrec.scores(states).float() / self.temperature, dim=-1)  # [N, items]
        out = []
        match = torch.ones_like(p, dtype=torch.bool)
        for lvl, size in enumerate(self.level_sizes):
            if lvl:
                match &= self.sids[:, lvl - 1].unsqueeze(0) == tgt_codes[:, lvl - 1 : lvl]
            q = torch.zeros(len(p), size, dtype=p.dtype, device=p.device)
            q.index_add_(1, self.sids[:, lvl], p * match)
            mass = q.sum(-1, keepdim=True)
            out.append(torch.where(mass > 1e-8, q / mass.clamp(min=1e-12), torch.zeros_like(q)))
        return out


def soft_level_loss(level_logits: list[torch.Tensor], soft: list[torch.Tensor]) -> torch.Tensor:
    """Mean over levels of the cross-entropy against the teacher's soft targets (rows without one skipped)."""
    losses = []
    for logits, q in zip(level_logits, soft):
        has = q.sum(-1) > 0
        if bool(has.any()):
            losses.append(F.cross_entropy(logits[has].float(), q[has]))
    return sum(losses[1:], losses[0]) / len(losses) if losses else level_logits[0].sum() * 0.0
