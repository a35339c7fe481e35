"""The jobs a verifier runs in batches from several callers (the verifier service's batcher, and
:class:`~specrec.verifier.local.LocalVerifier`'s own calls, each a batch of one), and which of them can share a
computation (:func:`group_key`); :func:`~specrec.verifier.local.run_jobs` runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    session with no beam search starts ``step``'s first; one with a search keeps its own (as a :class:`BeamJob`)."""

    session: Session | EncodeJob  # an EncodeJob: encode first, in the same batch
    sids: torch.Tensor  # [R, M, L]
    full: bool = False
    with_frontier: bool = False
    step: SearchSpec | None = None
    scores_only: bool = False  # nothing remembered for later steps: the scoring pass (``rank``) may serve it


@dataclass(eq=False)
class BeamJob:
    """The session's beam search: one more level (the first step starts ``search``; later ones keep the
    session's own), or, ``whole``, all of it from a fresh start."""

    session: Session | EncodeJob
    search: SearchSpec
    whole: bool = False


@dataclass(eq=False)
class HeadJob:
    session: Session | EncodeJob
    trie: SidTrie
    width: int
    distilled: bool = False  # the distilled drafter's beams instead of the NEZHA head's
    target_scores: bool = False  # (distilled) their token_logp the target's, from a tree pass in the same call


@dataclass(eq=False)
class DraftVerifyJob:
    session: Session | EncodeJob
    trie: SidTrie
    width: int
    n: int


@dataclass(eq=False)
class ExpandJob:
    session: Session | EncodeJob
    prefixes: torch.Tensor  # [R, M, l]
    head: bool = False  # the NEZHA head's distributions instead of the target's


Job = EncodeJob | ScoreJob | BeamJob | HeadJob | DraftVerifyJob | ExpandJob


def session_of(job: Any) -> Session:
    """A job's session (:func:`~specrec.verifier.local.run_jobs` put the session it encoded in place of an
    :class:`EncodeJob`)."""
    sess = job.session
    if not isinstance(sess, Session):
        raise TypeError(f"the job's session is a {type(sess).__name__}")
    return sess


def whole_search(job: Job) -> tuple[str, SidTrie, tuple[int, ...]] | None:
    """The whole search of the registry (:data:`~specrec.decoding.searches.SEARCHES`) a job asks for: its
    name, catalogue and widths; None for a job that is not one (or a beam search that must step: it reads
    what the session verified, or picks its beams by the relaxed rule)."""
    if isinstance(job, BeamJob):
        if job.whole and not session_of(job).state.verified and (job.search.rule is None
                                                               or job.search.rule.kind == "exact"):
            return "beam", job.search.trie, (job.search.width,)
        return None
    if isinstance(job, HeadJob):
        return ("draft_scored" if job.target_scores else "draft") if job.distilled else "head", job.trie, (job.width,)
    if isinstance(job, DraftVerifyJob):
        return "strict", job.trie, (job.width, job.n)
    return None


def group_key(n: int, job: Job) -> tuple:
    """Jobs with equal keys share one computation; ``("single", n)`` runs alone."""
    if isinstance(job, EncodeJob):
        return ("encode",)
    if isinstance(job, ScoreJob):
        return ("score", job.full)
    search = whole_search(job)
    if search is not None:
        name, trie, widths = search
        return ("search", name, id(trie), *widths)
    return ("single", n)
