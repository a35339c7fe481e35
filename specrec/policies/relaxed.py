"""``relaxed``: accept a drafted token when the target finds it good enough
(LASER / AtSpeed-R family). A documented approximation of ``beam``.

Level by level (see :mod:`.levelwise`), a drafted code c after a beam prefix
is *accepted* when the target's probability of c is at least ``threshold``
and c is within the target's ``top_k`` valid codes there. Accepted drafted
extensions take the beam slots first (best target score first), so the
search stays on the drafts, whose distributions are already computed; the
remaining slots go to the target's own best extensions. Scores are the
target's summed log-probabilities; the list is sorted by them.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..decoding.beam import Beams, select_topk
from .base import register
from .levelwise import LevelwiseConfig, LevelwisePolicy

PREFER = 1e4  # added to accepted drafted extensions when choosing beams, never kept in scores


class RelaxedConfig(LevelwiseConfig):
    threshold: float = Field(0.02, ge=0.0, le=1.0, description="minimum target probability of an accepted drafted code")
    top_k: int = Field(10, ge=1, description="an accepted drafted code is within the target's top-k valid codes")


@register
class RelaxedPolicy(LevelwisePolicy):
    name = "relaxed"
    Config = RelaxedConfig

    def select(self, beams: Beams, logp, trie, width, drafted):
        cfg = self.config
        r, bc, v = logp.shape
        level = beams.level
        allowed = trie.allowed_mask(level, beams.nodes.reshape(-1)).view(r, bc, v)
        masked = logp.masked_fill(~allowed, float("-inf"))
        in_top = torch.zeros_like(allowed)
        in_top.scatter_(-1, masked.topk(min(cfg.top_k, v), dim=-1).indices, True)
        good = in_top & allowed & (masked.exp() >= cfg.threshold)
        was_drafted = torch.zeros_like(allowed)
        alive = beams.alive()
        for i in range(r):
            for b in torch.nonzero(alive[i]).squeeze(1).tolist():
                codes = drafted[i].get(tuple(beams.codes[i, b].tolist()))
                if codes:
                    was_drafted[i, b, list(codes)] = True
        bias = (good & was_drafted).float() * PREFER
        new, flat_parent = select_topk(beams, logp + bias, trie, width)
        # restore the target's own scores, then order beams by them
        parent = flat_parent.view(r, -1) - torch.arange(r).unsqueeze(1) * bc
        code = new.codes[:, :, -1]
        tok = logp[torch.arange(r).unsqueeze(1), parent, code]
        scores = beams.scores.gather(1, parent) + tok
        dead = ~new.alive()
        scores = scores.masked_fill(dead, float("-inf"))
        token_logp = torch.cat([new.token_logp[:, :, :-1], tok.unsqueeze(-1)], dim=2)
        order = torch.argsort(scores, dim=1, descending=True, stable=True)
        g = order.unsqueeze(-1)
        return Beams(
            new.codes.gather(1, g.expand_as(new.codes)), scores.gather(1, order), new.nodes.gather(1, order),
            token_logp.gather(1, g.expand_as(token_logp)),
        )
