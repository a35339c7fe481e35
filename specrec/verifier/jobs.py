"""The jobs a verifier runs in batches from several callers (the verifier service's batcher, and
:class:`~specrec.verifier.local.LocalVerifier`'s own calls, each a batch of one), one dataclass per kind of work,
and which of them can share a computation (:func:`group_key`); :class:`~specrec.verifier.runner.Runner` runs them.

A whole search of the registry (:data:`~specrec.decoding.searches.SEARCHES`) is one kind of job, :class:`SearchJob`,
whatever the search: its name, widths and named tensors are data, so a new search adds no job type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..decoding.searches import SEARCHES
from ..ids.trie import SidTrie
from .types import SelectRule, Session


@dataclass(eq=False)
class EncodeJob:
    hist: np.ndarray  # [R, H, L] codes, rows of -1 = padding


@dataclass
class SearchSpec:
    """A constrained beam search: the valid SIDs (a catalogue's trie, or a request's view of it), the width
    and how a step picks its beams (None: the exact top-k)."""

    trie: SidTrie
    width: int
    rule: SelectRule | None = None


@dataclass(eq=False)
class ScoreJob:
    """Scores of ``sids``; with ``step`` (the verify-and-step of a ``specgr`` round) also the session's next
    beam step, read from the same pass (which then holds the frontier): the result is (scores, beams). A
    session with no beam search starts ``step``'s first; one with a search keeps its own."""

    session: Session | EncodeJob  # an EncodeJob: encode first, in the same batch
    sids: torch.Tensor  # [R, M, L]
    full: bool = False
    with_frontier: bool = False
    step: SearchSpec | None = None


@dataclass(eq=False)
class StepJob:
    """One more level of the session's own beam search (the first step starts ``search``; later ones keep the
    session's own)."""

    session: Session | EncodeJob
    search: SearchSpec


@dataclass(eq=False)
class SearchJob:
    """Whole search ``name`` of the registry over ``trie`` (unused by a search that reads no tables), of static
    ``widths`` (in the order the search names them), on the caller's named tensors ``args`` (``[R, M, ...]``);
    ``rule``: how the steps of a search that ``steps`` pick their beams (relaxed: it steps). The result is the
    search's value (:class:`~specrec.decoding.searches.Search`'s ``result`` type), or None where the backend
    cannot run it."""

    session: Session | EncodeJob
    name: str
    trie: SidTrie | None
    widths: tuple[int, ...]
    args: dict[str, torch.Tensor] = field(default_factory=dict)
    rule: SelectRule | None = None

    def stepped(self) -> bool:
        """The target's beam search that must step: it reads what the session verified, or picks its beams by
        the relaxed rule."""
        return SEARCHES[self.name].steps and (bool(session_of(self).state.verified)
                                              or (self.rule is not None and self.rule.kind != "exact"))


@dataclass(eq=False)
class ExpandJob:
    session: Session | EncodeJob
    prefixes: torch.Tensor  # [R, M, l]
    head: bool = False  # the NEZHA head's distributions instead of the target's


Job = EncodeJob | ScoreJob | StepJob | SearchJob | ExpandJob


def session_of(job: Any) -> Session:
    """A job's session (the runner put the session it encoded in place of an :class:`EncodeJob`)."""
    sess = job.session
    if not isinstance(sess, Session):
        raise TypeError(f"the job's session is a {type(sess).__name__}")
    return sess


def group_key(n: int, job: Job) -> tuple:
    """Jobs with equal keys share one computation; ``("single", n)`` runs alone."""
    if isinstance(job, EncodeJob):
        return ("encode",)
    if isinstance(job, ScoreJob):
        return ("score", job.full)
    if isinstance(job, SearchJob) and not job.stepped():
        return ("search", job.name, id(job.trie), *job.widths)
    return ("single", n)
