"""What a verifier is (:class:`Verifier`) and the values it passes: sessions, their state, the rules that pick
beams, what a bundle offers (:class:`Parts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

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
    verifier has): the distilled SID drafter (``sid_mlp``: the searches that run it) and the NEZHA draft head
    (``head_logprobs`` and the head's search). Policies plan with it, so a bundle
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

    def score(self, sess: Session, sids: torch.Tensor, full: bool = False, with_frontier: bool = False) -> Scores:
        """Token log-probs of candidates ``sids`` [R, M, L] (with ``full``, every level's distribution), in one
        pass the session remembers for its later beam steps (with ``with_frontier``, over its beams' prefixes
        too). Scores alone, nothing remembered: the registry's scoring pass, by
        :meth:`search`."""

    def score_step(self, sess: Session, sids: torch.Tensor) -> tuple[Scores, Beams]:
        """``score`` of ``sids`` [R, M, L] with the frontier, and the session's next beam step read from that
        same pass, in one call (after :meth:`beam_start`; the search must not be complete)."""

    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor: ...

    def beam_start(self, sess: Session, trie: SidTrie, width: int, rule: SelectRule | None = None) -> None: ...

    def beam_step(self, sess: Session) -> Beams: ...

    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]: ...

    def parts(self) -> Parts:
        """What this verifier's bundle offers (:class:`Parts`)."""

    def search(self, sess: Session, name: str, trie: SidTrie | None, widths: tuple[int, ...],
               args: dict[str, torch.Tensor] | None = None, rule: SelectRule | None = None) -> Any:
        """Whole search ``name`` of the registry (:data:`~specrec.decoding.searches.SEARCHES`) for the session,
        in one call: over ``trie``'s valid SIDs (a search that reads none: None), of static ``widths`` (in the
        order the search names them), on the caller's named tensors ``args``; ``rule``: how a search that
        ``steps`` picks its beams. -> the search's value (its ``result`` type: beams, ``strict``'s
        :class:`Drafted`, ``rank``'s token log-probabilities); None where the bundle has no distilled drafter
        and the search runs it (a missing NEZHA head is an error: callers plan with :meth:`parts`)."""

    def release(self, sess: Session) -> None: ...


@dataclass
class LocalState:
    enc: EncoderState
    verified: VerifiedPrefixes
    beam: BeamSearch | None = None
    rule: SelectRule = field(default_factory=SelectRule)
    head_h: torch.Tensor | None = None


class SessionStateError(RuntimeError):
    """An operation the session's state does not allow (e.g. stepping a finished search)."""
