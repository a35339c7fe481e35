"""Draft-target alignment (AtSpeed, ICLR'25): train the drafters on what the
target model itself would recommend, so that speculation gets accepted.

The target's top-K beams of a sample of training histories are computed once
and cached (:func:`target_beams`); training then reads, for each history, the
target's distributions along those beams from one tree pass (frozen GR), and
pulls the draft towards them:

``strict`` (AtSpeed-S, for lossless top-K verification)
    reverse KL(q || p) at every level along every target beam, plus a
    density term that puts q's mass on the target's top-K sequences
    (-log q(y) for y in the target's top K);

``relaxed`` (AtSpeed-R, for relaxed verification)
    the total variation distance between p and q at every level along the
    target beams.

Either is mixed with the recommendation loss on the true next item,
``alpha * rec + (1 - alpha) * align``. The NEZHA head (used by ``strict``,
``relaxed``, ``sample`` and ``nezha``) is aligned this way; the self-drafter
(a retriever: per item, not per level) is aligned by a multi-positive
softmax over the target's top-K items.

Model selection for an aligned drafter is by *coverage*: the share of the
target's top-K items (on validation histories) that the drafter's own top-2K
contains -- exactly what verification needs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from ..backends import Backend
from ..data.splits import Examples, sample_examples
from ..decoding.beam import beam_search
from ..decoding.tree import build_tree, read_level
from ..ids.trie import SidTrie
from ..models.tiger import Tiger
from ..terminal import progress_bar


class AlignConfig(BaseModel):
    mode: Literal["none", "strict", "relaxed"] = "none"
    alpha: float = Field(0.3, ge=0.0, le=1.0, description="weight of the recommendation loss")
    top_k: int = Field(10, ge=1, le=200, description="target beams distilled per history")
    examples: int = Field(30_000, ge=100, description="training histories whose target beams are cached")
    valid_examples: int = Field(2000, ge=100, description="validation histories for the coverage metric")


@dataclass
class TargetBeams:
    """The target's top-K beams of some examples: ``examples`` rows of the split, ``codes`` [N, K, L],
    ``alive`` [N, K]."""

    examples: Examples
    codes: np.ndarray
    alive: np.ndarray

    def items(self, trie: SidTrie) -> np.ndarray:
        n, k, levels = self.codes.shape
        items = trie.lookup(self.codes.reshape(-1, levels)).numpy().reshape(n, k)
        return np.where(self.alive, items, -1)


def target_beams(gr: Tiger, ex: Examples, sids: torch.Tensor, trie: SidTrie, k: int, cache=None,
                 batch_size: int = 128, progress: bool = True) -> TargetBeams:
    """Beam search of the (frozen) target on every example, cached on disk by content."""
    from .batches import history_batch

    key = hashlib.sha256()
    for t in (ex.history, ex.target, sids.numpy()):
        key.update(np.ascontiguousarray(t).tobytes())
    for v in gr.state_dict().values():
        key.update(v.detach().float().numpy().tobytes()[:4096])
    path = None if cache is None else cache / f"target_beams_k{k}_{key.hexdigest()[:16]}.npz"
    if path is not None and path.exists():
        z = np.load(path)
        return TargetBeams(ex, z["codes"], z["alive"])
    be = Backend(gr)
    codes, alive = [], []
    with torch.inference_mode():
        for s in progress_bar(range(0, len(ex), batch_size), desc="target beams", disable=not progress, leave=False):
            enc = be.encode(history_batch(sids, ex.history[s : s + batch_size]))
            b = beam_search(be, enc, trie, k)
            codes.append(b.codes.numpy())
            alive.append(b.alive.numpy())
    out = TargetBeams(ex, np.concatenate(codes), np.concatenate(alive))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, codes=out.codes, alive=out.alive)
    return out


def target_logprobs(backend: Backend, enc, codes: torch.Tensor, alive: torch.Tensor) -> list[torch.Tensor]:
    """The target's distribution at every level along beams [B, K, L]: a list of [B, K, V_j] (one tree pass)."""
    level_sizes = backend.cfg.level_sizes
    tree = build_tree([(codes.numpy(), alive.numpy())], level_sizes, codes.shape[0])
    out = backend.tree(enc, tree)
    return [read_level(out, tree.lookup(codes[:, :, :j].numpy()), j, level_sizes) for j in range(len(level_sizes))]


def head_alignment_loss(mode: str, q: list[torch.Tensor], p: list[torch.Tensor], codes: torch.Tensor,
                        alive: torch.Tensor) -> torch.Tensor:
    """q, p: per level [B, K, V_j] log-probs along the target beams ``codes`` [B, K, L]; mean over alive beams."""
    w = alive.float()
    n = w.sum().clamp(min=1)
    total = w.new_zeros(())
    for j, (lq, lp) in enumerate(zip(q, p)):
        if mode == "strict":
            per = (lq.exp() * (lq - lp)).sum(-1)  # reverse KL(q || p)
            per = per - lq.gather(-1, codes[:, :, j : j + 1].clamp(min=0)).squeeze(-1)  # density on the target's top-K
        else:
            per = 0.5 * (lq.exp() - lp.exp()).abs().sum(-1)  # total variation
        total = total + (per * w).sum() / n
    return total / len(q)


def coverage(draft_items: np.ndarray, target_items: np.ndarray) -> float:
    """Share of the target's (valid) top-K items found in the drafts, per history, averaged."""
    shares = []
    for d, t in zip(draft_items, target_items):
        t = t[t >= 0]
        if len(t):
            shares.append(np.isin(t, d).mean())
    return float(np.mean(shares)) if shares else 0.0


def sample_for_alignment(ex: Examples, n: int, seed: int) -> Examples:
    return sample_examples(ex, n, seed)


def self_draft_alignment_loss(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Multi-positive softmax: logits [B, N] over items, positives [B, K] item columns (-1 = none)."""
    lsm = F.log_softmax(logits, dim=-1)
    ok = positives >= 0
    picked = lsm.gather(1, positives.clamp(min=0))
    return -(picked * ok).sum() / ok.sum().clamp(min=1)
