"""Trie-constrained beam search over SIDs, batched over requests and beams.

Scores are sums of the model's (unconstrained) per-level log-probabilities;
codes the trie does not allow are masked to -inf before each top-k, so every
surviving beam is a prefix of a valid SID. When a request has fewer valid
continuations than the beam width, the extra beams are dead (``alive`` False,
score -inf) and are dropped from the final list.

Each step feeds one token per beam through the backend's KV-cached step
(:meth:`specrec.backends.Backend.step`); the cache reorder by beam parent is
folded into the next step. Where the next-level distributions are already
known (a prefix tree verified them, see :mod:`specrec.decoding.tree`), a step
reads them instead of computing (:class:`BeamSearch` ``source``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..ids.trie import SidTrie
from ..models.tiger import BOS_TOKEN, EncoderState
from .topk import constrained_topk


@dataclass
class StepCache:
    """The beam search's own cache, filled by the backend's step: the static self-attention cache
    [n_layers, R*B', h, L, dk] with B' = ``row_width`` rows per request (``beams`` of them real, the rest padding)."""

    k: torch.Tensor
    v: torch.Tensor
    row_width: int
    beams: int


@dataclass
class Beams:
    codes: torch.Tensor  # [R, B, l] prefix codes (levels 0..l-1)
    scores: torch.Tensor  # [R, B] cumulative log-probability (-inf = dead)
    token_logp: torch.Tensor  # [R, B, l] the log-probability of each code
    alive: torch.Tensor  # [R, B] bool: the beam is a valid prefix
    nodes: torch.Tensor | None = None  # [R, B] trie node at depth l (-1 = dead); None where no trie was walked

    @property
    def level(self) -> int:
        return self.codes.shape[2]

    @staticmethod
    def of_search(codes: torch.Tensor, scores: torch.Tensor, token_logp: torch.Tensor, nodes: torch.Tensor) -> Beams:
        """A whole search's beams (:data:`~specrec.decoding.searches.BEAMS`: its trie nodes, -1 where dead)."""
        nodes = nodes.long()
        return Beams(codes, scores, token_logp, nodes >= 0, nodes)

    def items(self, trie: SidTrie) -> torch.Tensor:
        """Item index of each complete beam [R, B]; -1 for dead beams. Beams that carry their trie nodes (a whole
        search's) read them as leaves; others walk the trie."""
        r, b, depth = self.codes.shape
        if self.nodes is not None and depth == trie.depth:
            leaf = self.nodes.numpy()
            return torch.from_numpy(np.where(leaf >= 0, trie.leaf_item.numpy()[np.maximum(leaf, 0)], -1))
        items = trie.lookup(self.codes.reshape(r * b, depth)).view(r, b)
        return torch.where(self.alive, items, torch.full_like(items, -1))

    def select(self, idx: torch.Tensor) -> Beams:
        nodes = None if self.nodes is None else self.nodes[idx]
        return Beams(self.codes[idx], self.scores[idx], self.token_logp[idx], self.alive[idx], nodes)

    def replace_rows(self, rows: torch.Tensor, other: Beams) -> Beams:
        """These beams with rows ``rows`` taken from ``other`` (one row per entry of ``rows``; up to this width,
        the rest of those rows dead)."""
        codes, scores, tlp, alive = self.codes.clone(), self.scores.clone(), self.token_logp.clone(), self.alive.clone()
        m = min(codes.shape[1], other.codes.shape[1])
        scores[rows], alive[rows] = float("-inf"), False
        codes[rows, :m], scores[rows, :m] = other.codes[:, :m], other.scores[:, :m]
        tlp[rows, :m], alive[rows, :m] = other.token_logp[:, :m], other.alive[:, :m]
        nodes = None
        if self.nodes is not None and other.nodes is not None:  # both carry their trie nodes: so do these
            nodes = self.nodes.clone()
            nodes[rows] = -1
            nodes[rows, :m] = other.nodes[:, :m]
        return Beams(codes, scores, tlp, alive, nodes)

    def trie_nodes(self, trie: SidTrie) -> torch.Tensor:
        """Trie node of every beam (walked when not carried)."""
        if self.nodes is not None:
            return self.nodes
        r, b, depth = self.codes.shape
        nodes = (
            trie.walk(self.codes.reshape(r * b, depth)).view(r, b) if depth else torch.zeros(r, b, dtype=torch.int64)
        )
        return torch.where(self.alive, nodes, torch.full_like(nodes, -1))


def root_beams(n_requests: int) -> Beams:
    return Beams(
        torch.zeros(n_requests, 1, 0, dtype=torch.int64),
        torch.zeros(n_requests, 1),
        torch.zeros(n_requests, 1, 0),
        torch.ones(n_requests, 1, dtype=torch.bool),
        torch.zeros(n_requests, 1, dtype=torch.int64),
    )


def select_topk(beams: Beams, logp: torch.Tensor, trie: SidTrie, width: int,
                bias: torch.Tensor | None = None) -> tuple[Beams, torch.Tensor]:
    """One constrained beam step over ``trie`` (:func:`~specrec.decoding.topk.constrained_topk`).
    ``logp`` [R, Bc, V] are next-level log-probs for each current beam; ``bias`` (same shape, optional) is
    added when *choosing* beams but never kept in their scores. Returns the new beams and, per new beam, the
    flat index ``r * Bc + parent`` of the beam it extends."""
    r, bc, v = logp.shape
    level = beams.level
    nodes = beams.trie_nodes(trie)
    allowed = trie.allowed_mask(level, nodes.reshape(-1)).view(r, bc, v)
    out = constrained_topk(beams.codes, beams.scores, beams.token_logp, logp, allowed, width,
                           lambda parent, code, _: trie.advance(level, nodes.gather(1, parent), code), bias)
    flat_parent = out.parent + torch.arange(r).unsqueeze(1) * bc
    return Beams(out.codes, out.scores, out.token_logp, out.nodes >= 0, out.nodes), flat_parent.reshape(-1)


def beam_tokens(beams: Beams, offsets: list[int]) -> torch.Tensor:
    """The decoder input token of each beam's next step: BOS at level 0, else its newest code."""
    level = beams.level
    if level == 0:
        return torch.full(beams.scores.shape, BOS_TOKEN, dtype=torch.int64)
    return beams.codes[:, :, -1].clamp(min=0) + offsets[level - 1]


#: reads known next-level log-probs for some beams: (beams) -> (logp [R, B, V], known [R, B] bool)
KnownSource = Callable[[Beams], tuple[torch.Tensor, torch.Tensor] | None]  # None: nothing verified yet


class BeamSearch:
    """Stepwise constrained beam search on a backend; ``run()`` decodes full SIDs.

    Callers that need intermediate prefixes (guided re-drafting, level-wise
    verification) call :meth:`step` themselves and read :attr:`beams`.

    With ``known``, a step first asks it for beams whose next-level log-probs
    are already known (verified drafts; it returns None while nothing is) and
    computes only the others, by ``compute_missing`` (one tree pass over their
    prefixes). Steps before anything is known are KV-cached backend steps;
    once a level was read, the cache lacks it, so later misses go by tree
    passes. ``select`` replaces the exact top-k (relaxed verification)."""

    def __init__(self, backend, enc: EncoderState, trie: SidTrie, width: int,
                 known: KnownSource | None = None,
                 compute_missing: Callable[[Beams, torch.Tensor], torch.Tensor] | None = None,
                 select: Callable[[Beams, torch.Tensor, SidTrie, int], tuple[Beams, torch.Tensor]] | None = None):
        self.backend, self.enc, self.trie, self.width = backend, enc, trie, width
        self.known, self.compute_missing = known, compute_missing
        self.select_fn = select or select_topk
        self.beams = root_beams(enc.n)
        self.cache: StepCache | Literal[False] | None = None  # False once abandoned for verified reads
        self.parent: torch.Tensor | None = None
        self.depth = backend.cfg.sid_len
        self.offsets = backend.cfg.offsets()
        self.logp: torch.Tensor | None = None  # last step's next-level log-probs [R, Bc, V]
        self.covered: torch.Tensor | None = None  # last step: [R] beams whose log-probs were known
        self.computed: torch.Tensor | None = None  # last step: [R] beams computed

    @property
    def done(self) -> bool:
        return self.beams.level >= self.depth

    def next_logprobs(self) -> torch.Tensor:
        """Log-probs of the next level for the current beams [R, B, V]."""
        b = self.beams
        got = self.known(b) if self.known is not None else None
        if got is None and self.cache is not False:  # nothing verified: a KV-cached step
            logp, self.cache = self.backend.step(
                self.enc, beam_tokens(b, self.offsets), b.level, self.parent, self.cache
            )
            self.covered = torch.zeros(b.alive.shape[0], dtype=torch.int64)
            self.computed = b.alive.sum(1)
            return logp
        self.cache = False  # from here on the KV cache misses levels: missing beams are computed by tree passes
        if got is None:
            got = (torch.zeros(*b.alive.shape, self.backend.cfg.level_sizes[b.level]), torch.zeros_like(b.alive))
        logp, known = got
        missing = b.alive & ~known
        self.covered = (b.alive & known).sum(1)
        self.computed = missing.sum(1)
        if bool(missing.any()):
            assert self.compute_missing is not None  # a search that reads known log-probs computes the rest
            logp = logp.clone()
            logp[missing] = self.compute_missing(b, missing)[missing]
        return logp

    def step(self) -> Beams:
        if self.done:
            raise RuntimeError("beam search already complete")
        self.logp = self.next_logprobs()
        self.beams, self.parent = self.select_fn(self.beams, self.logp, self.trie, self.width)
        return self.beams

    def run(self) -> Beams:
        while not self.done:
            self.step()
        return self.beams

    def select_requests(self, idx: torch.Tensor, enc: EncoderState) -> BeamSearch:
        """The same search restricted to requests ``idx`` (``enc`` already selected)."""
        new = BeamSearch(self.backend, enc, self.trie, self.width, self.known, self.compute_missing, self.select_fn)
        new.beams = self.beams.select(idx)
        new.cache = self.cache
        if self.cache is not None and self.cache is not False:
            c = self.cache
            rows = (idx.view(-1, 1) * c.row_width + torch.arange(c.row_width)).reshape(-1)
            new.cache = StepCache(c.k.index_select(1, rows), c.v.index_select(1, rows), c.row_width, c.beams)
            b = self.beams.codes.shape[1]
            assert self.parent is not None  # set by the step that made the cache
            within = self.parent.view(-1, b)[idx] - idx.view(-1, 1) * c.beams
            new.parent = (within + torch.arange(len(idx)).view(-1, 1) * c.beams).reshape(-1)
        return new


@torch.inference_mode()
def beam_search(backend, enc: EncoderState, trie: SidTrie, width: int) -> Beams:
    """The whole search: in one backend call where the backend has one, else step by step."""
    beams = backend.search("beam", enc, trie, (width,))
    return beams if beams is not None else BeamSearch(backend, enc, trie, width).run()
