"""``beam``: the target's constrained beam search in one graph, and the level-by-level descent it shares with
``resume`` (:func:`descend`).

One decoder pass per level over the kept beams, each attending to its ancestors' keys/values kept from the
earlier passes (at most L): unlike the hot path's static-cache step, nothing is reordered or rewritten per
step, which made beam 1.20x (K=10) to 1.57x (K=50) faster end to end on the CPU (``bench/results/HISTORY.md``,
"Policies side by side"). Its reference is :func:`specrec.decoding.beam.beam_search` (eager, KV-cached steps).

Distillation reads this same search (:func:`search` with a ``watch``): the target's frontier it learns is what
each level's pass saw, so the drafter is taught the search that serves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...ids.tables import Level
from ...models.hotpath import Cross, FusedHotPath
from .common import SearchState
from .registry import BEAMS, Search

#: sees each level's decoder pass of :func:`search`: (level, the beams it extends (prefixes of length ``level``;
#: the root at level 0), their decoder states [R, W, d], their next level's log-probs [R, W, Vmax])
Watch = Callable[[int, SearchState, torch.Tensor, torch.Tensor], None]


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], width: int):
    """-> codes [R, W, L], scores [R, W], token_logp [R, W, L], nodes [R, W] (-1 = dead)."""
    return search(fused, fused.cross(enc_mask, cross_k, cross_v), tables, width).beams()


def search(fused: FusedHotPath, cross: Cross, tables: list[Level], width: int,
           watch: Watch | None = None) -> SearchState:
    """The whole search on a request's encoder state (:meth:`FusedHotPath.cross`) -> its final beams; ``watch``
    (optional) sees every level's pass, the root's first."""
    r, dev = cross.bias.shape[0], cross.bias.device
    h0, kept = fused.root(cross)
    root, logp = SearchState.root(r, dev), fused.level_logprobs(h0, 0).view(-1, 1, fused.vmax)
    if watch is not None:
        watch(0, root, h0.unsqueeze(1), logp)
    state, _ = root.advance(logp, tables[0], width)
    anc = torch.zeros(r, state.codes.shape[1], 1, dtype=torch.int64, device=dev)  # columns into ``kept``
    return descend(fused, state, anc, kept, cross, tables, width, watch)


def descend(fused: FusedHotPath, state: SearchState, anc, kept, cross: Cross, tables: list[Level],
            width: int, watch: Watch | None = None) -> SearchState:
    """The beam search's remaining levels from ``state`` (prefixes of length l): one decoder pass per level
    over the kept beams, each beam attending to its ancestors ``anc`` [R, W, l] (columns into the earlier
    passes' keys/values ``kept``, the root first) and itself."""
    r, dev = state.codes.shape[0], state.codes.device
    for level in range(state.codes.shape[2], fused.L):
        w = state.codes.shape[1]
        own = torch.arange(w, device=dev).view(1, w, 1).expand(r, -1, -1) + kept[0].shape[1]
        cols = torch.cat([anc, own], -1)  # [R, W, level + 1]: the root, the beam's ancestors, itself
        x = fused.tok[state.codes[:, :, -1].clamp(min=0) + fused.offsets[level - 1]] + fused.dec_pos[level]
        hid, kept = fused.ancestor_pass(x, cols, kept, cross)
        logp = fused.level_logprobs(hid, level)
        if watch is not None:
            watch(level, state, hid, logp)
        state, par = state.advance(logp, tables[level], width)
        anc = cols.gather(1, par.unsqueeze(-1).expand(-1, -1, cols.shape[-1]))
    return state


def _stepped(backend, enc, trie, width: int):
    """The eager backend has no whole call for the target's beam search: None, and the verifier steps it (the
    reference, :class:`~specrec.decoding.beam.BeamSearch`)."""
    return None


SEARCH = Search("beam", run, BEAMS, steps=True, final=True, eager=_stepped, warm=lambda k, drafts: [(k,)])
