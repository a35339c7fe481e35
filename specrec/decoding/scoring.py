"""Teacher-forced scoring of candidate SIDs, and what a session has verified.

Every candidate of every request goes through one decoder pass over a
:class:`~specrec.decoding.tree.PrefixTree` of their unique prefixes; the
encoder output is reused, never recomputed.

:class:`VerifiedPrefixes` remembers the passes of one session: a later beam
step whose prefixes were verified reads their distributions instead of
computing them (this is how ``strict`` and ``specgr`` share passes with their
beam search).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.tiger import EncoderState
from .tree import PrefixTree, build_tree, read_level, token_logprobs


@dataclass
class Scores:
    token_logp: torch.Tensor  # [R, M, L] log p(c_t | c_<t, history), unconstrained
    full: list[torch.Tensor] | None = None  # per level t: [R, M, V_t] full log-probs

    def total(self, levels: int | None = None) -> torch.Tensor:
        """Sum of the first ``levels`` token log-probs (all by default)."""
        return self.token_logp[..., : levels or self.token_logp.shape[-1]].sum(-1)


def _np(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def tree_pass(backend, enc: EncoderState, groups, drafts: int | None = None) -> tuple[PrefixTree, torch.Tensor]:
    """One decoder pass over the unique prefixes of ``groups`` ((codes, ok) pairs)."""
    tree = build_tree([(_np(c), _np(o)) for c, o in groups], backend.cfg.level_sizes, enc.n, drafts=drafts)
    return tree, backend.tree(enc, tree)


def score_sids(backend, enc: EncoderState, sids: torch.Tensor, full: bool = False) -> Scores:
    """sids: [R, M, L] candidate codes per request (pad rows with any valid
    SID and ignore their scores)."""
    ok = np.ones(sids.shape[:2], dtype=bool)
    tree, out = tree_pass(backend, enc, [(sids, ok)])
    token, per_level = token_logprobs(out, tree, _np(sids), full)
    return Scores(token, per_level)


def prefix_logprobs(backend, enc: EncoderState, codes: torch.Tensor) -> torch.Tensor:
    """Next-level log-probs after each prefix: codes [R, M, l] -> [R, M, V_l] (one tree pass)."""
    c = _np(codes)
    tree, out = tree_pass(backend, enc, [(c, np.ones(c.shape[:2], dtype=bool))])
    return read_level(out, tree.lookup(c), c.shape[2], backend.cfg.level_sizes)


class VerifiedPrefixes:
    """The tree passes of one session, looked up by prefix.

    ``rows`` maps the session's current requests to each pass's rows, so the
    store follows :meth:`select` (requests leaving a batch early)."""

    def __init__(self, level_sizes: list[int]):
        self.level_sizes = list(level_sizes)
        self.passes: list[tuple[PrefixTree, torch.Tensor, np.ndarray]] = []

    def __bool__(self) -> bool:
        return bool(self.passes)

    def add(self, tree: PrefixTree, out: torch.Tensor, rows: np.ndarray | None = None) -> None:
        """Remember a pass; ``rows`` are this session's rows in it (default: all, in order)."""
        self.passes.append((tree, out, np.arange(tree.tokens.shape[0]) if rows is None else np.asarray(rows)))

    def select(self, idx: torch.Tensor) -> VerifiedPrefixes:
        new = VerifiedPrefixes(self.level_sizes)
        ix = _np(idx)
        new.passes = [(t, o, rows[ix]) for t, o, rows in self.passes]
        return new

    def read(self, prefixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-level log-probs of prefixes [R, B, l] where known: (logp [R, B, V], known [R, B])."""
        c = _np(prefixes)
        r, b, depth = c.shape
        logp = torch.zeros(r, b, self.level_sizes[depth])
        known = np.zeros((r, b), dtype=bool)
        for tree, out, rows in reversed(self.passes):
            cols = tree.lookup(c, rows)
            hit = (cols >= 0) & ~known
            if hit.any():
                got = read_level(out, cols, depth, self.level_sizes, rows)
                h = torch.from_numpy(hit)
                logp[h] = got[h]
                known |= hit
            if known.all():
                break
        return logp, torch.from_numpy(known)

    def was_drafted(self, prefixes: torch.Tensor) -> torch.Tensor:
        """[R, B, V] bool: the code after each prefix [R, B, l] extends a verified draft."""
        c = _np(prefixes)
        out = np.zeros((*c.shape[:2], self.level_sizes[c.shape[2]]), dtype=bool)
        for tree, _, rows in self.passes:
            out |= tree.was_drafted(c, rows)
        return torch.from_numpy(out)
