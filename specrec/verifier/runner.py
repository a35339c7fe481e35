"""The batch runner (:class:`Runner`): the jobs of several callers (:mod:`.jobs`), batching what can share a
pass. Every batched operation of :class:`~specrec.verifier.local.LocalVerifier` is a batch of one job through it,
the path the verifier service's batcher runs many callers' jobs on.

Each kind of job has its one handler: encodes run together (also the encodes of jobs that carry an
:class:`~.jobs.EncodeJob` as their session), scores together (one tree pass over every caller's rows and
frontiers), whole searches of one name, catalogue and widths together, in one call of the backend's one entry
point (``backend.search``); the rest one at a time. A search is data here (its name, widths and tensors, read
from the registry, :data:`~specrec.decoding.searches.SEARCHES`): nothing in this module names one."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from ..decoding.beam import Beams
from ..decoding.scoring import Scores, tree_pass
from ..decoding.searches import SEARCHES, rows
from ..decoding.tree import token_logprobs
from ..models.tiger import EncoderState
from .jobs import EncodeJob, ExpandJob, Job, ScoreJob, SearchJob, SearchSpec, StepJob, group_key, session_of
from .types import LocalState, SelectRule, Session, SessionStateError, StepCoverage


class Sessions(Protocol):
    """What the runner needs of the verifier it runs for (:class:`~specrec.verifier.local.LocalVerifier`)."""

    backend: Any
    level_sizes: list[int]

    def session(self, enc: EncoderState) -> Session: ...

    def frontier(self, st: LocalState) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def beam_start(self, sess: Session, trie, width: int, rule: SelectRule | None = None) -> None: ...

    def take_step(self, sess: Session) -> Beams: ...

    def stepwise_search(self, sess: Session, search: SearchSpec) -> Beams: ...

    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor: ...

    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]: ...


class Runner:
    """Runs jobs for ``verifier`` on its backend: :meth:`run` gives exactly one result per job, in order; a
    failing job gets its exception as its result and the others are unaffected."""

    def __init__(self, verifier: Sessions):
        self.v = verifier

    def run(self, jobs: list[Job]) -> list[Any]:
        out: list[Any] = [None] * len(jobs)
        # jobs that carry a history instead of a session: encode them first, all in one batch
        embedded: list[Any] = [j for j in jobs if isinstance(getattr(j, "session", None), EncodeJob)]
        if embedded:
            sessions: list[Any]
            try:
                with torch.inference_mode():
                    sessions = self._encode([j.session for j in embedded])
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
                    results = self._group(key[0], [jobs[n] for n in idx])
                except Exception as exc:  # noqa: BLE001 - the group failed together: each caller learns why
                    results = [exc] * len(idx)
                for n, r in zip(idx, results):
                    out[n] = r
        return out

    def _group(self, kind: str, jobs: list) -> list[Any]:
        """The jobs of one group (``kind``: the first entry of :func:`~.jobs.group_key`'s key) -> one result each."""
        if kind == "encode":
            return self._encode(jobs)
        if kind == "score":
            return self._score(jobs)
        if kind == "search":
            return self._search(jobs)
        return [_attempt(self._single, j) for j in jobs]

    # -- one handler per kind of job ------------------------------------------------------------------------
    def _encode(self, jobs: list[EncodeJob]) -> list[Session]:
        enc = self.v.backend.encode(torch.from_numpy(np.concatenate([j.hist for j in jobs])))
        return [self.v.session(enc.select(torch.arange(a, b))) for a, b in _split([len(j.hist) for j in jobs])]

    def _single(self, job: Job) -> Any:
        sess = session_of(job)
        if isinstance(job, StepJob):
            st: LocalState = sess.state
            if st.beam is None:
                self.v.beam_start(sess, job.search.trie, job.search.width, job.search.rule)
            elif st.beam.done:
                raise SessionStateError("session: its beam search is already complete")
            return self.v.take_step(sess)
        if isinstance(job, SearchJob):  # the target's beam search that must step (:meth:`SearchJob.stepped`)
            return self.v.stepwise_search(sess, _spec(job))
        if isinstance(job, ExpandJob):
            return (self.v.head_logprobs if job.head else self.v.next_logprobs)(sess, job.prefixes)
        raise TypeError(f"not a verifier job: {type(job).__name__}")

    def _search(self, jobs: list[SearchJob]) -> list[Any]:
        """Whole searches of one name, catalogue and widths, in one call of the backend (``backend.search``),
        the callers' tensors concatenated (their candidate axis padded to the largest). Where the backend cannot
        run it (it answers None): a search that ``steps`` steps, the others answer None."""
        first, s = jobs[0], SEARCHES[jobs[0].name]
        args, counts = _cat_args(jobs)
        out = self.v.backend.search(first.name, _cat_encoders(jobs), first.trie, first.widths, args)
        if out is None:
            if s.steps:
                return [_attempt(self.v.stepwise_search, session_of(j), _spec(j)) for j in jobs]
            return [None] * len(jobs)
        res = []
        for j, (a, b), m in zip(jobs, _split([session_of(j).n for j in jobs]), counts):
            part = rows(out, a, b, m) if len(jobs) > 1 or m is not None else out
            if s.steps:  # every level computed in the one call, none read from a verified pass
                alive = part.alive.sum(1).tolist()
                session_of(j).coverage.extend(StepCoverage([0] * (b - a), alive) for _ in self.v.level_sizes)
            res.append(part)
        return res

    def _ready_to_step(self, job: ScoreJob) -> BaseException | None:
        """A job with ``step``: its session's search started (before the pass, so that the pass holds its root
        frontier too), or why it cannot step."""
        sess = session_of(job)
        st: LocalState = sess.state
        assert job.step is not None  # asked only for jobs that step
        if st.beam is None:
            return _attempt(self.v.beam_start, sess, job.step.trie, job.step.width, job.step.rule)
        if st.beam.done:
            return SessionStateError("session: its beam search is already complete")
        return None

    def _score(self, jobs: list[ScoreJob]) -> list[Any]:
        """One tree pass over every caller's candidate rows (and the beam frontiers of the jobs that ask); each
        session remembers its rows of it; a job with ``step`` then takes its beam step, reading the pass."""
        res: list[Any] = [self._ready_to_step(j) if j.step is not None else None for j in jobs]
        live = [n for n, r in enumerate(res) if r is None]
        if not live:
            return res
        batch = [jobs[n] for n in live]
        sids = _padded([j.sids for j in batch])
        spans = _split([len(j.sids) for j in batch])
        n_rows = len(sids)
        groups: list[tuple[Any, Any]] = [(sids, np.ones(sids.shape[:2], bool))]
        for j, (a, _) in zip(batch, spans):
            if j.with_frontier or j.step is not None:
                groups += [_rows_of(codes, alive, a, n_rows) for codes, alive in self.v.frontier(session_of(j).state)]
        tree, out = tree_pass(self.v.backend, _cat_encoders(batch), groups, drafts=1)
        token, full = token_logprobs(out, tree, sids.numpy(), any(j.full for j in batch))
        for n, j, (a, b) in zip(live, batch, spans):
            session_of(j).state.verified.add(tree, out, rows=np.arange(a, b))
            mm = j.sids.shape[1]
            scores = Scores(token[a:b, :mm], [f[a:b, :mm] for f in full] if j.full else None)
            if j.step is None:
                res[n] = scores
            else:
                beams = _attempt(self.v.take_step, session_of(j))  # part of this one call (not a call of its own)
                res[n] = beams if isinstance(beams, BaseException) else (scores, beams)
        return res


def _spec(job: SearchJob) -> SearchSpec:
    """A search job of the target's beam search as the beam search a session takes step by step."""
    assert job.trie is not None  # a search that steps reads the catalogue
    return SearchSpec(job.trie, job.widths[0], job.rule)


def _split(counts: list[int]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for n in counts:
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


def _padded(xs: list[torch.Tensor]) -> torch.Tensor:
    """Tensors [R_i, M_i, ...] as one [sum R_i, max M_i, ...], each padded by repeating its first candidate."""
    m = max(x.shape[1] for x in xs)
    return torch.cat([torch.cat([x, x[:, :1].expand(-1, m - x.shape[1], *x.shape[2:])], 1) for x in xs])


def _cat_args(jobs: list[SearchJob]) -> tuple[dict[str, torch.Tensor], list[int | None]]:
    """The jobs' tensors, concatenated by name (:func:`_padded`), and each job's candidate count (None: it hands
    none)."""
    names = list(jobs[0].args)
    if not names:
        return {}, [None] * len(jobs)
    return {k: _padded([j.args[k] for j in jobs]) for k in names}, [j.args[names[0]].shape[1] for j in jobs]


def _rows_of(codes: torch.Tensor, alive: torch.Tensor, start: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One session's prefixes (codes [n, B, l], alive [n, B]) as rows ``start``.. of a pass over ``n_rows`` rows."""
    n = codes.shape[0]
    if start == 0 and n == n_rows:
        return codes, alive
    c = torch.zeros((n_rows, *codes.shape[1:]), dtype=codes.dtype)
    ok = torch.zeros((n_rows, codes.shape[1]), dtype=torch.bool)
    c[start : start + n], ok[start : start + n] = codes, alive
    return c, ok
