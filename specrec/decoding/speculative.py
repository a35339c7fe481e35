"""Exact speculative sampling of fixed-length SIDs, with residual correction.

For a draft token y ~ q at a position, the target's distribution there is p:

- accept y with probability ``min(1, p(y) / q(y))``;
- on rejection sample from the residual ``max(p - q, 0)``, normalised
  (when p == q the residual is empty and rejection cannot happen; it then
  falls back to p);
- the draft after a rejected position is discarded and re-drafted from the
  corrected prefix in the next round.

Each committed token is then distributed exactly as p given its prefix, so a
whole SID is a sample from the target. ``p`` and ``q`` must be the
*processed* distributions: the same temperature, top-k truncation and
validity mask applied to both (:func:`transform`).

:func:`speculative_sample` is written against two callables so that the same
loop runs on the GR model (policy ``sample``) and on small explicit tables
(the exactness tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def transform(
    logits: torch.Tensor, allowed: torch.Tensor | None = None, temperature: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Sampling distribution from logits (or log-probs): divide by the
    temperature, drop codes not ``allowed``, keep the ``top_k`` best (0 = all),
    renormalise. Applied identically to target and draft."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    x = logits.float() / temperature
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.softmax(x, dim=-1)


def accept_prob(p_y: torch.Tensor, q_y: torch.Tensor) -> torch.Tensor:
    """min(1, p(y)/q(y)) for drafted tokens (q(y) > 0 since y was drawn from q)."""
    return torch.clamp(p_y / q_y.clamp(min=1e-30), max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0), normalised; p itself where that mass is zero (p == q)."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=1e-30), p)


@dataclass
class SampleStats:
    """Per stream: draft rounds it took part in, and drafted / accepted tokens by position."""

    rounds_per_stream: torch.Tensor  # [n] int64
    drafted: torch.Tensor  # [n, depth] int64
    accepted: torch.Tensor  # [n, depth] int64

    @property
    def rounds(self) -> int:
        return int(self.rounds_per_stream.max()) if len(self.rounds_per_stream) else 0

    @property
    def draft_tokens(self) -> int:
        return int(self.drafted.sum())

    @property
    def accepted_tokens(self) -> int:
        return int(self.accepted.sum())


def speculative_sample(
    p_fn: Callable[[torch.Tensor], list[torch.Tensor]],
    q_next: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    depth: int,
    generator: torch.Generator | None = None,
    residual_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual,
) -> tuple[torch.Tensor, torch.Tensor, SampleStats]:
    """Draw ``n`` independent sequences of length ``depth`` from the target.

    ``q_next(seq[:, :j])`` -> draft distribution at position j, [n, V_j];
    ``p_fn(seq)`` -> target distributions at every position j given
    ``seq[:, :j]``, a list of [n, V_j] (one verifier pass).
    Returns (sequences [n, depth], target log-probability of each, stats)."""
    seq = torch.zeros(n, depth, dtype=torch.int64)
    logp = torch.zeros(n)
    length = torch.zeros(n, dtype=torch.int64)  # committed tokens per stream
    st = SampleStats(torch.zeros(n, dtype=torch.int64), torch.zeros(n, depth, dtype=torch.int64),
                     torch.zeros(n, depth, dtype=torch.int64))
    while bool((length < depth).any()):
        active = length < depth
        st.rounds_per_stream += active.long()
        qs: list[torch.Tensor | None] = [None] * depth
        for j in range(int(length[active].min()), depth):
            q = q_next(seq[:, :j])
            qs[j] = q
            rows = active & (length <= j)
            y = torch.multinomial(q[rows], 1, generator=generator).squeeze(1)
            seq[rows, j] = y
        P = p_fn(seq)
        verifying = active.clone()
        for j in range(depth):
            rows = verifying & (length == j)
            if not bool(rows.any()):
                continue
            idx = torch.nonzero(rows).squeeze(1)
            q_j = qs[j]
            assert q_j is not None  # drafted this round: j is at or past the shortest active stream
            p, q = P[j][idx], q_j[idx]
            y = seq[idx, j]
            a = accept_prob(p.gather(1, y[:, None]).squeeze(1), q.gather(1, y[:, None]).squeeze(1))
            u = torch.rand(len(idx), generator=generator)
            acc = u < a
            st.drafted[idx, j] += 1
            st.accepted[idx, j] += acc.long()
            rej = idx[~acc]
            if len(rej):
                z = torch.multinomial(residual_fn(p[~acc], q[~acc]), 1, generator=generator).squeeze(1)
                seq[rej, j] = z
                verifying[rej] = False
            tok = seq[idx, j]
            logp[idx] += torch.log(p.gather(1, tok[:, None]).squeeze(1))
            length[idx] = j + 1
    return seq, logp, st
