"""The in-process verifier (:class:`LocalVerifier`): the GR model on a backend, and :func:`run_jobs`, which runs
the jobs of several callers (:mod:`.jobs`) batching what can share a pass; every batched operation of
:class:`LocalVerifier` is a batch of one job through it, the path the verifier service batches many callers'
jobs on."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..deadline import Deadline
from ..decoding.beam import Beams, BeamSearch, select_topk
from ..decoding.scoring import Scores, VerifiedPrefixes, prefix_logprobs, tree_pass
from ..decoding.searches.head import nezha_beam_search
from ..decoding.tree import read_level, token_logprobs
from ..ids.trie import SidTrie
from ..models.tiger import EncoderState
from .jobs import (
    BeamJob,
    DraftVerifyJob,
    EncodeJob,
    ExpandJob,
    HeadJob,
    Job,
    ScoreJob,
    SearchSpec,
    group_key,
    session_of,
    whole_search,
)
from .types import Drafted, LocalState, Parts, SelectRule, Session, SessionStateError, StepCoverage


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
    job through :func:`run_jobs`, the path the verifier service batches many
    callers' jobs on."""

    def __init__(self, backend, head=None, head_model=None):
        self.backend = backend
        self.cfg = backend.cfg
        self.head = head
        self.head_model = head_model if head_model is not None else getattr(backend, "model", None)
        self.level_sizes = list(self.cfg.level_sizes)

    def _one(self, job: Job) -> Any:
        """One job through the batched path; its error is raised here."""
        (out,) = run_jobs(self, [job])
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
    def _frontier(self, st: LocalState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The session's current beam prefixes (codes [R, B, l], alive [R, B]), while its search is not complete."""
        b = st.beam.beams if st.beam is not None and not st.beam.done else None
        return [] if b is None or b.level >= len(self.level_sizes) else [(b.codes, b.alive)]

    def score(self, sess: Session, sids: torch.Tensor, full: bool = False, with_frontier: bool = False,
              scores_only: bool = False) -> Scores:
        return self._one(ScoreJob(sess, sids, full, with_frontier, scores_only=scores_only))

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
        return self._step(sess)

    def _step(self, sess: Session) -> Beams:
        """One level of the session's started search, its coverage recorded."""
        beam = _search_of(sess.state)
        beams = beam.step()
        assert beam.covered is not None and beam.computed is not None  # every step sets them
        sess.coverage.append(StepCoverage(beam.covered.tolist(), beam.computed.tolist()))
        return beams

    def beam_search(self, sess: Session, trie: SidTrie, width: int, rule: SelectRule | None = None) -> Beams:
        return self._one(BeamJob(sess, SearchSpec(trie, width, rule), whole=True))

    def _stepwise_search(self, sess: Session, search: SearchSpec) -> Beams:
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

    def head_beams(self, sess: Session, trie: SidTrie, width: int) -> Beams:
        """NEZHA drafts: the head's constrained beams (valid SIDs only)."""
        if self.head is None:
            raise RuntimeError("this verifier has no NEZHA draft head")
        return self._one(HeadJob(sess, trie, width))

    def _head_beams_eager(self, sess: Session, trie: SidTrie, width: int) -> Beams:
        """The head's search in eager torch (a backend without a whole head-search call)."""
        return nezha_beam_search(self.head, self.head_model, self._head_h(sess), trie, width)

    # -- the distilled drafter ----------------------------------------------------------------------------
    def parts(self) -> Parts:
        return Parts(distilled_drafter=self.backend.drafter is not None, draft_head=self.head is not None)

    def draft_verify(self, sess: Session, trie: SidTrie, width: int, n: int) -> Drafted | None:
        return self._one(DraftVerifyJob(sess, trie, width, n)) if self.parts().distilled_drafter else None

    def draft_beams(self, sess: Session, trie: SidTrie, width: int, target_scores: bool = False) -> Beams | None:
        if not self.parts().distilled_drafter:
            return None
        return self._one(HeadJob(sess, trie, width, distilled=True, target_scores=target_scores))


def run_jobs(verifier: LocalVerifier, jobs: list[Job]) -> list[Any]:
    """Execute the jobs of several callers, batching what can share a pass:
    encodes together (also the encodes of jobs that carry an :class:`EncodeJob`
    as their session: ``job.session`` is then the new session); scores
    together (one tree pass over every caller's rows and frontiers); whole beam
    searches, head searches and draft-and-verify calls of the same catalogue and
    width together. Exactly one result per job, in order; a failing job gets its
    exception as its result and the others are unaffected."""
    out: list[Any] = [None] * len(jobs)
    # jobs that carry a history instead of a session: encode them first, all in one batch
    embedded: list[Any] = [j for j in jobs if isinstance(getattr(j, "session", None), EncodeJob)]
    if embedded:
        try:
            with torch.inference_mode():
                sessions = _run_group(verifier, ("encode",), [j.session for j in embedded])
        except Exception as exc:  # noqa: BLE001
            sessions = [exc] * len(embedded)
        for j, s in zip(embedded, sessions):
            j.session = s
    groups: dict[tuple, list[int]] = {}
    for n, job in enumerate(jobs):
        failed = getattr(job, "session", None)
        if isinstance(failed, Exception):  # its encode failed
            out[n] = failed
            continue
        groups.setdefault(group_key(n, job), []).append(n)
    with torch.inference_mode():
        for key, idx in groups.items():
            try:
                results = _run_group(verifier, key, [jobs[n] for n in idx])
            except Exception as exc:  # noqa: BLE001 - the group failed together: each caller learns why
                results = [exc] * len(idx)
            for n, r in zip(idx, results):
                out[n] = r
    return out


def _split(enc_rows: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in enc_rows:
        spans.append((start, start + n))
        start += n
    return spans


def _attempt(fn, *args) -> Any:
    """``fn(*args)``, or the exception it raised (one job's result)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - attached to this job's result
        return exc


def _cat_encoders(jobs: list) -> EncoderState:
    encs = [session_of(j).state.enc for j in jobs]
    return encs[0] if len(encs) == 1 else EncoderState.cat(encs)


def _run_group(ver: LocalVerifier, key: tuple, jobs: list) -> list[Any]:
    """The jobs of one group (``key``: :func:`_group_key`'s) -> one result each."""
    kind = key[0]
    if kind == "encode":
        enc = ver.backend.encode(torch.from_numpy(np.concatenate([j.hist for j in jobs])))
        return [ver.session(enc.select(torch.arange(a, b))) for a, b in _split([len(j.hist) for j in jobs])]
    if kind == "score":
        return _score_group(ver, jobs)
    if kind == "search":
        return _search_group(ver, key[1], jobs)
    return [_run_one(ver, j) for j in jobs]


def _ready_to_step(ver: LocalVerifier, job: ScoreJob) -> BaseException | None:
    """A job with ``step``: its session's search started (before the pass, so that the pass holds its root
    frontier too), or why it cannot step."""
    sess = session_of(job)
    st: LocalState = sess.state
    assert job.step is not None  # asked only for jobs that step
    if st.beam is None:
        return _attempt(ver.beam_start, sess, job.step.trie, job.step.width, job.step.rule)
    if st.beam.done:
        return SessionStateError("session: its beam search is already complete")
    return None


def _score_group(ver: LocalVerifier, jobs: list[ScoreJob]) -> list[Any]:
    """One tree pass over every caller's candidate rows (and the beam frontiers of the jobs that ask); each
    session remembers its rows of it; a job with ``step`` then takes its beam step, reading the pass. Where every
    job asks for its candidates' token log-probs only (``scores_only``), the pass is the registry's ``rank``
    (each node's own level's head, ancestor attention) and nothing is remembered."""
    res: list[Any] = [_ready_to_step(ver, j) if j.step is not None else None for j in jobs]
    live = [n for n, r in enumerate(res) if r is None]
    if not live:
        return res
    batch = [jobs[n] for n in live]
    m = max(j.sids.shape[1] for j in batch)
    sids = torch.cat([torch.cat([j.sids, j.sids[:, :1].expand(-1, m - j.sids.shape[1], -1)], 1) for j in batch])
    spans = _split([len(j.sids) for j in batch])
    if all(j.scores_only and not (j.full or j.with_frontier or j.step is not None) for j in batch):
        token = ver.backend.rank(_cat_encoders(batch), sids)
        for n, j, (a, b) in zip(live, batch, spans):
            res[n] = Scores(token[a:b, : j.sids.shape[1]])
        return res
    rows = len(sids)
    groups: list[tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] = [(sids, np.ones(sids.shape[:2], bool))]
    for j, (a, _) in zip(batch, spans):
        if j.with_frontier or j.step is not None:
            groups += [_rows_of(codes, alive, a, rows) for codes, alive in ver._frontier(session_of(j).state)]
    tree, out = tree_pass(ver.backend, _cat_encoders(batch), groups, drafts=1)
    token, full = token_logprobs(out, tree, sids.numpy(), any(j.full for j in batch))
    for n, j, (a, b) in zip(live, batch, spans):
        session_of(j).state.verified.add(tree, out, rows=np.arange(a, b))
        mm = j.sids.shape[1]
        scores = Scores(token[a:b, :mm], [f[a:b, :mm] for f in full] if j.full else None)
        if j.step is None:
            res[n] = scores
        else:
            beams = _attempt(ver._step, session_of(j))  # part of this one call (not a call of its own)
            res[n] = beams if isinstance(beams, BaseException) else (scores, beams)
    return res


def _rows_of(codes: torch.Tensor, alive: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One session's prefixes (codes [n, B, l], alive [n, B]) as rows ``start``.. of a pass over ``rows`` rows."""
    n = codes.shape[0]
    if start == 0 and n == rows:
        return codes, alive
    c = torch.zeros((rows, *codes.shape[1:]), dtype=codes.dtype)
    ok = torch.zeros((rows, codes.shape[1]), dtype=torch.bool)
    c[start : start + n], ok[start : start + n] = codes, alive
    return c, ok


def _search_group(ver: LocalVerifier, name: str, jobs: list) -> list[Any]:
    """Whole searches ``name`` (:data:`~specrec.decoding.searches.SEARCHES`) of one catalogue and widths, in one
    call of the backend's method for it (the registry's ``backend``). Where the backend has none (it answers
    None): a beam search steps, the NEZHA head searches in eager torch, and the distilled drafter's searches
    (no drafter) answer None."""
    enc, first = _cat_encoders(jobs), jobs[0]
    _, trie, widths = whole_search(first)  # type: ignore[misc]  # a search group's jobs are searches
    out = getattr(ver.backend, name)(enc, trie, *widths)  # the backend's method named as the search
    if out is None:
        if name == "beam":
            return [_attempt(ver._stepwise_search, session_of(j), j.search) for j in jobs]
        if name == "head":
            return [_attempt(ver._head_beams_eager, session_of(j), j.trie, j.width) for j in jobs]
        return [None] * len(jobs)
    spans = _split([session_of(j).n for j in jobs])
    if name == "strict":
        beams, covered, frontier = out
        return [Drafted(beams.select(torch.arange(a, b)), np.asarray(covered[a:b], dtype=bool),
                        np.asarray(frontier[a:b]))
                for a, b in spans]
    res = []
    for j, (a, b) in zip(jobs, spans):
        part = out.select(torch.arange(a, b)) if len(jobs) > 1 else out
        if name == "beam":  # every level computed in the one call, none read from a verified pass
            alive = part.alive.sum(1).tolist()
            session_of(j).coverage.extend(StepCoverage([0] * (b - a), alive) for _ in ver.level_sizes)
        res.append(part)
    return res


def _run_one(ver: LocalVerifier, job) -> Any:
    try:
        if not isinstance(job, (BeamJob, ExpandJob)):
            raise TypeError(f"not a verifier job: {type(job).__name__}")
        sess = session_of(job)
        if isinstance(job, BeamJob):
            if job.whole:
                return ver._stepwise_search(sess, job.search)
            st: LocalState = sess.state
            if st.beam is None:
                ver.beam_start(sess, job.search.trie, job.search.width, job.search.rule)
            elif st.beam.done:
                raise SessionStateError("session: its beam search is already complete")
            return ver.beam_step(sess)
        if job.head:
            return ver.head_logprobs(sess, job.prefixes)
        return ver.next_logprobs(sess, job.prefixes)
    except Exception as exc:  # noqa: BLE001 - attached to this job's result
        return exc
