"""What the whole searches share: beams inside a graph (:class:`SearchState`), the distilled drafter's beams
after the root pass (:func:`draft`), one decoder pass over drafted prefixes (:func:`ancestor_tree`), the
second, small pass over the target's last beams (:func:`leaf_pass`) and prefix keys (:func:`prefix_keys`).

Every function takes the hot path (:class:`~specrec.models.hotpath.FusedHotPath`, the model maths) first;
nothing here holds weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ids.tables import Level, children
from ...models.hotpath import Cross, FusedHotPath
from ..topk import constrained_topk


class SearchState:
    """Beams inside a graph: codes [R, B, l], scores, token log-probs, trie nodes."""

    def __init__(self, codes, scores, token_logp, nodes):
        self.codes, self.scores, self.token_logp, self.nodes = codes, scores, token_logp, nodes

    @staticmethod
    def root(r: int, device: torch.device | None = None) -> SearchState:
        return SearchState(torch.zeros(r, 1, 0, dtype=torch.int64, device=device), torch.zeros(r, 1, device=device),
                           torch.zeros(r, 1, 0, device=device), torch.zeros(r, 1, dtype=torch.int64, device=device))

    def advance(self, logp, level: Level, width: int):
        """One constrained top-k (:func:`~specrec.decoding.topk.constrained_topk`) over logp [R, B, V], the
        item set's ``level`` (:func:`~specrec.ids.tables.children`) telling the valid codes -> (next state,
        parent beam [R, W])."""
        _, b, v = logp.shape
        child = children(level, self.nodes, v).reshape(-1, b, v)  # a dead beam's node -1 has no children
        out = constrained_topk(self.codes, self.scores, self.token_logp, logp, child >= 0, width,
                               lambda parent, code, idx: child.reshape(-1, b * v).gather(1, idx))
        return SearchState(out.codes, out.scores, out.token_logp, out.nodes), out.parent

    def beams(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a search returns (:data:`~.registry.BEAMS`): codes [R, W, l], scores [R, W], token_logp
        [R, W, l], trie nodes [R, W] (-1 = dead)."""
        return self.codes, self.scores, self.token_logp, self.nodes


def draft(fused: FusedHotPath, cross: Cross, tables, widths: list[int], keys: bool = True):
    """Root pass, level 0 exact (the target's), then the distilled drafter's levels; ``widths[j]`` beams kept
    after level j. Returns (h0, the root's key|value per layer (none without ``keys``: no tree pass follows),
    the kept states per level, their parent beams per level)."""
    r = cross.bias.shape[0]
    h0, kv = fused.root(cross, keys=keys)
    logp = fused.level_logprobs(h0, 0).view(-1, 1, fused.vmax)
    states, parents = [], []
    state = SearchState.root(r, h0.device)
    for level, w in enumerate(widths):
        if level > 0:
            logp = fused.drafter_logprobs(h0, state.codes)
        state, par = state.advance(logp, tables[level], w)
        states.append(state)
        parents.append(par)
    return h0, kv, states, parents


def ancestor_tree(fused: FusedHotPath, states, parents, root_kv, cross: Cross,
                  chains: list | None = None) -> tuple[list[torch.Tensor], list]:
    """One decoder pass over kept prefixes: ``states[j]`` the prefixes of length j+1 (j = 0..D-1, D <= L-1),
    each beam's parent in ``parents[j]``. Each node attends to its ancestors only (the root, whose
    keys/values come from the root pass, and at most D more), and only its own level's output layer is
    computed. Returns per depth j+1 the next level's log-probs [R, B_j, Vmax] after each kept prefix, and
    each layer's keys|values [R, 1 + T, 2 * inner] (the root first: for a later pass that attends to these
    nodes); with ``chains`` (a list), each depth's ancestor columns into them [R, B_j, j+1] are appended."""
    r, dev = cross.bias.shape[0], cross.bias.device
    states = states[: fused.L - 1]
    D = len(states)
    # nodes: depth j+1 = states[j], laid out depth after depth
    sizes = [s.codes.shape[1] for s in states]
    starts = [sum(sizes[:j]) for j in range(D)]
    t = sum(sizes)
    anc_parts: list[torch.Tensor] = []
    tok: list[torch.Tensor] = []
    chain = None  # per depth: each node's ancestor columns (1-based: column 0 is the root)
    for j, s in enumerate(states):
        own = torch.arange(sizes[j], device=dev).view(1, -1).expand(r, -1) + (1 + starts[j])
        if chain is None:
            chain = own.unsqueeze(-1)
        else:
            chain = torch.cat([chain.gather(1, parents[j].unsqueeze(-1).expand(-1, -1, chain.shape[-1])),
                               own.unsqueeze(-1)], -1)
        if chains is not None:
            chains.append(chain)
        anc_parts.append(F.pad(torch.cat([torch.zeros_like(own).unsqueeze(-1), chain], -1), (0, D - 1 - j)))
        tok.append(fused.tok[s.codes[:, :, -1].clamp(min=0) + fused.offsets[j]] + fused.dec_pos[j + 1])
    anc = torch.cat(anc_parts, 1)  # [R, T, D+1]: ancestor columns (root, depth 1.., self), then padding
    depth = torch.cat([torch.full((sizes[j],), j + 1, dtype=torch.int64, device=dev) for j in range(D)])
    slot_ok = torch.arange(D + 1, device=dev).view(1, D + 1) <= depth.view(-1, 1)  # [T, D+1]
    abias = fused.mask_bias(slot_ok).view(1, t, D + 1, 1)
    x = torch.cat(tok, 1)  # [R, T, d]
    hid, kept = fused.ancestor_pass(x, anc, root_kv, cross, abias)
    return [fused.level_logprobs(hid[:, starts[j] : starts[j] + sizes[j]], j + 1) for j in range(D)], kept


def leaf_pass(fused: FusedHotPath, codes, anc, kept, cross: Cross):
    """A second pass over the target's own beams of length L-1 (``codes`` [R, W, L-1]), whose ancestors are
    nodes of an earlier :func:`ancestor_tree` pass: ``anc`` [R, W, L-1] their columns in its keys/values
    ``kept`` (root, depth 1 .. L-2). -> level L-1's log-probs [R, W, Vmax]."""
    r, w, _ = codes.shape
    L = fused.L
    x = fused.tok[codes[:, :, -1].clamp(min=0) + fused.offsets[L - 2]] + fused.dec_pos[L - 1]
    own = torch.arange(w, device=codes.device).view(1, w, 1).expand(r, -1, -1) + kept[0].shape[1]
    hid, _ = fused.ancestor_pass(x, torch.cat([anc, own], -1), kept, cross)
    return fused.level_logprobs(hid, L - 1)


def prefix_keys(sizes: list[int], codes):
    """Mixed-radix key of each prefix codes [R, B, j] (``sizes``: the levels' code counts; codes of dead beams
    may be anything)."""
    key = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=codes.device)
    for j in range(codes.shape[-1]):
        key = key * sizes[j] + codes[..., j].clamp(min=0)
    return key
