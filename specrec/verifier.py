"""The verifier: the GR model behind a small, session-based interface.

A policy encodes a batch of histories once (:meth:`Verifier.encode` returns a
:class:`Session`) and then asks, as often as it likes and with no further
encoder work, for

- ``score``: teacher-forced log-probs of candidate SIDs (one pass);
- ``next_logprobs``: next-level distributions after given prefixes;
- ``beam_step``: one more level of the session's own constrained beam search
  (KV-cached), or ``beam_search`` for the whole of it;
- ``head_*``: NEZHA draft-head distributions and beams (one extra decoder pass
  per session, cached).

:class:`LocalVerifier` runs in-process (torch or ONNX Runtime). The verifier
service exposes the same operations over gRPC and the gateway's remote
verifier implements this interface against it, so policies run unchanged.
Every implementation counts its work in :attr:`Session.calls`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .decoding.beam import Beams, BeamSearch, prefix_logprobs
from .decoding.scoring import Scores, score_sids
from .ids.trie import SidTrie
from .models.tiger import EncoderState


@dataclass
class Session:
    """Per-batch verifier state. ``calls`` counts operations by kind
    ("encode", "score", "step", "expand", "head"); ``state`` is the
    implementation's own."""

    n: int
    state: Any = None
    calls: Counter = field(default_factory=Counter)


class Verifier(Protocol):
    level_sizes: list[int]

    def encode(self, hist_sids: torch.Tensor) -> Session: ...

    def select(self, sess: Session, idx: torch.Tensor) -> Session: ...

    def score(self, sess: Session, sids: torch.Tensor, full: bool = False) -> Scores: ...

    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor: ...

    def beam_start(self, sess: Session, trie: SidTrie, width: int) -> None: ...

    def beam_step(self, sess: Session) -> Beams: ...

    def beam_search(self, sess: Session, trie: SidTrie, width: int) -> Beams: ...

    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]: ...

    def head_beams(self, sess: Session, trie: SidTrie, width: int) -> Beams: ...

    def release(self, sess: Session) -> None: ...


@dataclass
class LocalState:
    enc: EncoderState
    beam: BeamSearch | None = None
    head_h: torch.Tensor | None = None


class LocalVerifier:
    """In-process verifier over a :class:`~specrec.models.tiger.Tiger` (or an
    ONNX Runtime backend with the same decoding interface) and, optionally, a
    NEZHA draft head (torch only; ``head_model`` is the torch GR it reads)."""

    def __init__(self, model, head=None, head_model=None):
        self.model = model
        self.head = head
        self.head_model = head_model if head_model is not None else model
        self.level_sizes = list(model.cfg.level_sizes)

    @torch.inference_mode()
    def encode(self, hist_sids: torch.Tensor) -> Session:
        sess = Session(n=hist_sids.shape[0], state=LocalState(self.model.encode(hist_sids)))
        sess.calls["encode"] += 1
        return sess

    def select(self, sess: Session, idx: torch.Tensor) -> Session:
        st: LocalState = sess.state
        new = LocalState(st.enc.select(idx))
        if st.head_h is not None:
            new.head_h = st.head_h[idx]
        if st.beam is not None:
            new.beam = st.beam.select(idx, new.enc)
        return Session(n=len(idx), state=new, calls=sess.calls)

    @torch.inference_mode()
    def score(self, sess: Session, sids: torch.Tensor, full: bool = False) -> Scores:
        sess.calls["score"] += 1
        return score_sids(self.model, sess.state.enc, sids, full=full)

    @torch.inference_mode()
    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor:
        sess.calls["expand"] += 1
        return prefix_logprobs(self.model, sess.state.enc, prefixes)

    def beam_start(self, sess: Session, trie: SidTrie, width: int) -> None:
        sess.state.beam = BeamSearch(self.model, sess.state.enc, trie, width)

    @torch.inference_mode()
    def beam_step(self, sess: Session) -> Beams:
        sess.calls["step"] += 1
        return sess.state.beam.step()

    def beam_search(self, sess: Session, trie: SidTrie, width: int) -> Beams:
        self.beam_start(sess, trie, width)
        while not sess.state.beam.done:
            self.beam_step(sess)
        return sess.state.beam.beams

    # -- NEZHA draft head ----------------------------------------------------
    def _head_h(self, sess: Session) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("this verifier has no NEZHA draft head")
        st: LocalState = sess.state
        if st.head_h is None:
            sess.calls["head"] += 1
            st.head_h = self.head.hidden(self.head_model, st.enc)
        return st.head_h

    @torch.inference_mode()
    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]:
        return self.head.prefix_logprobs(self.head_model, self._head_h(sess), prefixes)

    @torch.inference_mode()
    def head_beams(self, sess: Session, trie: SidTrie, width: int) -> Beams:
        """NEZHA drafts: the head's constrained beams (valid SIDs only)."""
        return self.head.beam_search(self.head_model, self._head_h(sess), trie, width)

    def release(self, sess: Session) -> None:
        sess.state = None
