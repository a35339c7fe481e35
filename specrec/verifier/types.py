"""What a verifier is (:class:`Verifier`) and the values it passes: sessions, their state, the rules that pick
beams, what a bundle offers (:class:`Parts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from ..deadline import Deadline
from ..decoding.beam import Beams, BeamSearch
from ..decoding.scoring import Scores, VerifiedPrefixes
from ..ids.trie import SidTrie
from ..models.tiger import EncoderState


@dataclass
class SelectRule:
    """How a beam step picks its beams: the exact top-k, or relaxed
    verification (LASER / AtSpeed-R): a drafted code whose target probability
    is >= ``threshold`` and within the target's ``top_k`` valid codes takes a
    beam slot before any code that was not drafted."""

    kind: Literal["exact", "relaxed"] = "exact"
    threshold: float = 0.02
    top_k: int = 10


@dataclass
class StepCoverage:
    """One beam step: per request, beams read from verified passes and beams computed."""

    covered: list[int]
    computed: list[int]


@dataclass(frozen=True)
class Parts:
    """What a verifier's bundle offers beyond the GR model (whose encode, scores and beam search every
    verifier has): the distilled SID drafter (``sid_mlp``: :meth:`Verifier.draft_verify`,
    :meth:`Verifier.draft_beams`) and the NEZHA draft head (``head_*``). Policies plan with it, so a bundle
    without a part is served by what it has instead of failing on a call it cannot answer."""

    distilled_drafter: bool = True
    draft_head: bool = True

    def __and__(self, other: Parts) -> Parts:
        """What both offer (a deployment's replicas together)."""
        return Parts(self.distilled_drafter and other.distilled_drafter, self.draft_head and other.draft_head)


@dataclass
class Session:
    """Per-batch verifier state: ``coverage`` has one entry per beam step; ``state`` is the implementation's own."""

    n: int
    state: Any = None
    coverage: list[StepCoverage] = field(default_factory=list)


class Verifier(Protocol):
    level_sizes: list[int]

    def encode(self, hist_sids: torch.Tensor, deadline: Deadline | None = None) -> Session:
        """The session of histories ``hist_sids`` [R, H, L]; ``deadline``: the requests' (a remote verifier's
        calls for the session end at its ``verifier_at``, and stop when it is cancelled)."""

    def prepare(self, sess: Session) -> None:
        """Make the session's encoder state ready now (a remote verifier starts
        encoding in the background; a policy that drafts first calls it)."""

    def select(self, sess: Session, idx: torch.Tensor) -> Session: ...

    def score(self, sess: Session, sids: torch.Tensor, full: bool = False, with_frontier: bool = False,
              scores_only: bool = False) -> Scores:
        """Token log-probs of candidates ``sids`` [R, M, L] (with ``full``, every level's distribution), in one
        pass the session remembers for its later beam steps (with ``with_frontier``, over its beams' prefixes
        too); ``scores_only``: nothing remembered, the verifier's scoring pass may serve it."""

    def score_step(self, sess: Session, sids: torch.Tensor) -> tuple[Scores, Beams]:
        """``score`` of ``sids`` [R, M, L] with the frontier, and the session's next beam step read from that
        same pass, in one call (after :meth:`beam_start`; the search must not be complete)."""

    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor: ...

    def beam_start(self, sess: Session, trie: SidTrie, width: int, rule: SelectRule | None = None) -> None: ...

    def beam_step(self, sess: Session) -> Beams: ...

    def beam_search(self, sess: Session, trie: SidTrie, width: int, rule: SelectRule | None = None) -> Beams: ...

    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]: ...

    def head_beams(self, sess: Session, trie: SidTrie, width: int) -> Beams: ...

    def parts(self) -> Parts:
        """What this verifier's bundle offers (:class:`Parts`)."""

    def draft_verify(self, sess: Session, trie: SidTrie, width: int, n: int) -> Drafted | None:
        """``strict`` in one call: the distilled drafter's ``n`` beams per level (level 0 exact), one tree
        pass over them and the target's beam search of ``width`` read from it; None without a distilled
        drafter."""

    def draft_beams(self, sess: Session, trie: SidTrie, width: int, target_scores: bool = False) -> Beams | None:
        """The distilled drafter's own constrained beams (level 0 exact); None without one. With
        ``target_scores`` their ``token_logp`` are the target's log-probabilities of each code, from one tree
        pass over the beams in the same call (``specgr``'s first round: drafted and verified at once)."""

    def release(self, sess: Session) -> None: ...


@dataclass
class Drafted:
    """What :meth:`Verifier.draft_verify` returns: the target's beams (equal to its beam search in every row:
    a row whose drafts missed is finished from the levels the tree verified, in the same call), ``covered``
    [R] bool (the drafts held the target's whole frontier), per level 0..L-2 the target's kept prefixes and
    how many of them the tree held (``frontier`` [R, L-1, 2])."""

    beams: Beams
    covered: np.ndarray
    frontier: np.ndarray


@dataclass
class LocalState:
    enc: EncoderState
    verified: VerifiedPrefixes
    beam: BeamSearch | None = None
    rule: SelectRule = field(default_factory=SelectRule)
    head_h: torch.Tensor | None = None


class SessionStateError(RuntimeError):
    """An operation the session's state does not allow (e.g. stepping a finished search)."""
