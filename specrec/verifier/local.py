"""The in-process verifier (:class:`LocalVerifier`): the GR model on a backend. Every batched operation is a batch
of one job (:mod:`.jobs`) through its :class:`~.runner.Runner`, the path the verifier service batches many
callers' jobs on."""

from __future__ import annotations

from typing import Any

import torch

from ..deadline import Deadline
from ..decoding.beam import Beams, BeamSearch, select_topk
from ..decoding.scoring import Scores, VerifiedPrefixes, prefix_logprobs, tree_pass
from ..decoding.searches import SEARCHES
from ..decoding.tree import read_level
from ..ids.trie import SidTrie
from ..models.tiger import EncoderState
from .jobs import Job, ScoreJob, SearchJob, SearchSpec
from .runner import Runner
from .types import LocalState, Parts, SelectRule, Session, StepCoverage


def _search_of(st: LocalState) -> BeamSearch:
    """The session's started beam search."""
    if st.beam is None:
        raise RuntimeError("beam_start first")
    return st.beam


PREFER = 1e4  # added to preferred (relaxed-accepted) extensions when choosing beams, never kept in scores


def relaxed_select(verified: VerifiedPrefixes, rule: SelectRule):
    """The relaxed rule as a beam-selection function (see :class:`SelectRule`)."""

    def select(beams: Beams, logp: torch.Tensor, trie: SidTrie, width: int):
        r, bc, v = logp.shape
        allowed = trie.allowed_mask(beams.level, beams.trie_nodes(trie).reshape(-1)).view(r, bc, v)
        masked = logp.masked_fill(~allowed, float("-inf"))
        kth = masked.topk(min(rule.top_k, v), dim=-1).values[..., -1:]
        good = (masked >= kth) & (masked.exp() >= rule.threshold) & allowed & beams.alive.unsqueeze(-1)
        bias = (good & verified.was_drafted(beams.codes)).float() * PREFER
        return select_topk(beams, logp, trie, width, bias=bias)

    return select


class LocalVerifier:
    """In-process verifier on a backend (:mod:`specrec.backends`) and,
    optionally, a NEZHA draft head (its level transitions run in eager torch
    on the GR model ``head_model``). Its batched operations are batches of one
    job through its :attr:`runner`, the path the verifier service batches many
    callers' jobs on."""

    def __init__(self, backend, head=None, head_model=None):
        self.backend = backend
        self.cfg = backend.cfg
        self.head = head
        self.head_model = head_model if head_model is not None else getattr(backend, "model", None)
        self.level_sizes = list(self.cfg.level_sizes)
        self.runner = Runner(self)

    def _one(self, job: Job) -> Any:
        """One job through the batched path; its error is raised here."""
        (out,) = self.runner.run([job])
        if isinstance(out, BaseException):
            raise out
        return out

    # -- sessions -------------------------------------------------------------------
    def encode(self, hist_sids: torch.Tensor, deadline: Deadline | None = None) -> Session:
        del deadline  # in-process, the policy's own budget checks are the only ones
        return self.session(self.backend.encode(hist_sids))

    def prepare(self, sess: Session) -> None:
        """Nothing to do: encoding is eager in-process."""

    def session(self, enc: EncoderState) -> Session:
        return Session(n=enc.n, state=LocalState(enc, VerifiedPrefixes(self.level_sizes)))

    def select(self, sess: Session, idx: torch.Tensor) -> Session:
        st: LocalState = sess.state
        enc = st.enc.select(idx)
        new = LocalState(enc, st.verified.select(idx))
        if st.head_h is not None:
            new.head_h = st.head_h[idx]
        if st.beam is not None:
            new.beam, new.rule = st.beam.select_requests(idx, enc), st.rule
            self._bind(new)
        return Session(n=len(idx), state=new, coverage=sess.coverage)

    def release(self, sess: Session) -> None:
        sess.state = None

    # -- verification --------------------------------------------------------------------
    def frontier(self, st: LocalState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The session's current beam prefixes (codes [R, B, l], alive [R, B]), while its search is not complete."""
        b = st.beam.beams if st.beam is not None and not st.beam.done else None
        return [] if b is None or b.level >= len(self.level_sizes) else [(b.codes, b.alive)]

    def score(self, sess: Session, sids: torch.Tensor, full: bool = False, with_frontier: bool = False) -> Scores:
        return self._one(ScoreJob(sess, sids, full, with_frontier))

    def score_step(self, sess: Session, sids: torch.Tensor) -> tuple[Scores, Beams]:
        st: LocalState = sess.state
        beam = _search_of(st)
        return self._one(ScoreJob(sess, sids, with_frontier=True, step=SearchSpec(beam.trie, beam.width, st.rule)))

    @torch.inference_mode()
    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor:
        return prefix_logprobs(self.backend, sess.state.enc, prefixes)

    # -- beam search ------------------------------------------------------------------------
    def beam_start(self, sess: Session, trie: SidTrie, width: int, rule: SelectRule | None = None) -> None:
        st: LocalState = sess.state
        st.rule = rule or SelectRule()
        st.beam = BeamSearch(self.backend, st.enc, trie, width)
        self._bind(st)

    def _bind(self, st: LocalState) -> None:
        """Point the session's beam search at the session's verified passes (again after a select)."""
        beam = _search_of(st)
        beam.known = lambda b: st.verified.read(b.codes) if st.verified else None
        beam.compute_missing = lambda b, missing: self._compute_missing(st, b, missing)
        if st.rule.kind == "relaxed":
            beam.select_fn = relaxed_select(st.verified, st.rule)

    def _compute_missing(self, st: LocalState, beams: Beams, missing: torch.Tensor) -> torch.Tensor:
        """One tree pass over the missing beams' prefixes (remembered like any pass)."""
        tree, out = tree_pass(self.backend, st.enc, [(beams.codes, missing)], drafts=0)
        st.verified.add(tree, out)
        return read_level(out, tree.lookup(beams.codes.numpy()), beams.level, self.level_sizes)

    @torch.inference_mode()
    def beam_step(self, sess: Session) -> Beams:
        _search_of(sess.state)
        return self.take_step(sess)

    def take_step(self, sess: Session) -> Beams:
        """One level of the session's started search, its coverage recorded."""
        beam = _search_of(sess.state)
        beams = beam.step()
        assert beam.covered is not None and beam.computed is not None  # every step sets them
        sess.coverage.append(StepCoverage(beam.covered.tolist(), beam.computed.tolist()))
        return beams

    def stepwise_search(self, sess: Session, search: SearchSpec) -> Beams:
        """The whole search level by level (reading what the session verified), from a fresh start."""
        self.beam_start(sess, search.trie, search.width, search.rule)
        beam = _search_of(sess.state)
        while not beam.done:
            self.beam_step(sess)
        return beam.beams

    # -- NEZHA draft head ----------------------------------------------------------------------
    def _head_h(self, sess: Session) -> torch.Tensor:
        if self.head is None:
            raise RuntimeError("this verifier has no NEZHA draft head")
        st: LocalState = sess.state
        if st.head_h is None:
            st.head_h = self.backend.head_hidden(st.enc)
        return st.head_h

    @torch.inference_mode()
    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]:
        return self.head.prefix_logprobs(self.head_model, self._head_h(sess), prefixes)

    # -- whole searches ---------------------------------------------------------------------------------------
    def parts(self) -> Parts:
        return Parts(distilled_drafter=self.backend.drafter is not None, draft_head=self.head is not None)

    def search(self, sess: Session, name: str, trie: SidTrie | None, widths: tuple[int, ...],
               args: dict[str, torch.Tensor] | None = None, rule: SelectRule | None = None) -> Any:
        s = SEARCHES[name]
        if s.uses_sid_drafter and not self.parts().distilled_drafter:
            return None
        if s.uses_head and self.head is None:
            raise RuntimeError("this verifier has no NEZHA draft head")
        return self._one(SearchJob(sess, name, trie, tuple(widths), dict(args or {}), rule))
