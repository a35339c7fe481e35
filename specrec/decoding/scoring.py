"""Teacher-forced scoring of many candidate SIDs in one decoder pass.

All candidates of all requests go through the decoder together; the encoder
output (and its cross-attention keys/values) is reused, never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.tiger import EncoderState, Tiger


@dataclass
class Scores:
    token_logp: torch.Tensor  # [R, M, L] log p(c_t | c_<t, history), unconstrained
    full: list[torch.Tensor] | None = None  # per level t: [R, M, V_t] full log-probs

    def total(self, levels: int | None = None) -> torch.Tensor:
        """Sum of the first ``levels`` token log-probs (all by default)."""
        return self.token_logp[..., : levels or self.token_logp.shape[-1]].sum(-1)

    def mean(self, levels: torch.Tensor | int | None = None) -> torch.Tensor:
        """Length-normalised log-likelihood; ``levels`` may vary per candidate
        ([R, M] tensor), e.g. L-1 for unseen items (SpecGR)."""
        lp = self.token_logp
        if levels is None:
            return lp.mean(-1)
        if isinstance(levels, int):
            return lp[..., :levels].mean(-1)
        t = torch.arange(lp.shape[-1])
        keep = t.view(1, 1, -1) < levels.unsqueeze(-1)
        return (lp * keep).sum(-1) / levels.clamp(min=1)


def score_sids(model: Tiger, enc: EncoderState, sids: torch.Tensor, full: bool = False) -> Scores:
    """sids: [R, M, L] candidate codes per request (pad rows with any valid
    SID and ignore their scores)."""
    per_level, _ = model.next_logprobs(enc, model.decoder_input(sids[..., :-1]))
    token_lp, full_lp = [], []
    for t, lp in enumerate(per_level):
        token_lp.append(lp.gather(-1, sids[..., t : t + 1]).squeeze(-1))
        if full:
            full_lp.append(lp)
    return Scores(torch.stack(token_lp, dim=-1), full_lp if full else None)
