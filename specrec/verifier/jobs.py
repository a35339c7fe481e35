"""Batches of jobs from several callers (the verifier service's batcher, and
:class:`~specrec.verifier.local.LocalVerifier`'s own calls, each a batch of one): the job types and
:func:`run_jobs`, which runs what can share a pass together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..decoding.scoring import Scores, tree_pass
from ..decoding.tree import token_logprobs
from ..ids.trie import SidTrie
from ..models.tiger import EncoderState
from .types import Drafted, LocalState, SelectRule, Session, SessionStateError, StepCoverage

if TYPE_CHECKING:
    from .local import LocalVerifier


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


def _session(job: Any) -> Session:
    """A job's session (:func:`run_jobs` put the session it encoded in place of an :class:`EncodeJob`)."""
    sess = job.session
    if not isinstance(sess, Session):
        raise TypeError(f"the job's session is a {type(sess).__name__}")
    return sess


def whole_search(job: Job) -> tuple[str, SidTrie, tuple[int, ...]] | None:
    """The whole search of the registry (:data:`~specrec.decoding.searches.SEARCHES`) a job asks for: its
    name, catalogue and widths; None for a job that is not one (or a beam search that must step: it reads
    what the session verified, or picks its beams by the relaxed rule)."""
    if isinstance(job, BeamJob):
        if job.whole and not _session(job).state.verified and (job.search.rule is None
                                                               or job.search.rule.kind == "exact"):
            return "beam", job.search.trie, (job.search.width,)
        return None
    if isinstance(job, HeadJob):
        return ("score" if job.target_scores else "draft") if job.distilled else "head", job.trie, (job.width,)
    if isinstance(job, DraftVerifyJob):
        return "strict", job.trie, (job.width, job.n)
    return None


def _group_key(n: int, job: Job) -> tuple:
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
        groups.setdefault(_group_key(n, job), []).append(n)
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
    encs = [_session(j).state.enc for j in jobs]
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
    sess = _session(job)
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
            groups += [_rows_of(codes, alive, a, rows) for codes, alive in ver._frontier(_session(j).state)]
    tree, out = tree_pass(ver.backend, _cat_encoders(batch), groups, drafts=1)
    token, full = token_logprobs(out, tree, sids.numpy(), any(j.full for j in batch))
    for n, j, (a, b) in zip(live, batch, spans):
        _session(j).state.verified.add(tree, out, rows=np.arange(a, b))
        mm = j.sids.shape[1]
        scores = Scores(token[a:b, :mm], [f[a:b, :mm] for f in full] if j.full else None)
        if j.step is None:
            res[n] = scores
        else:
            beams = _attempt(ver._step, _session(j))  # part of this one call (not a call of its own)
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
    (no drafter, or no dense tables for this catalogue) answer None."""
    enc, first = _cat_encoders(jobs), jobs[0]
    _, trie, widths = whole_search(first)  # type: ignore[misc]  # a search group's jobs are searches
    out = getattr(ver.backend, name)(enc, trie, *widths)  # the backend's method named as the search
    if out is None:
        if name == "beam":
            return [_attempt(ver._stepwise_search, _session(j), j.search) for j in jobs]
        if name == "head":
            return [_attempt(ver._head_beams_eager, _session(j), j.trie, j.width) for j in jobs]
        return [None] * len(jobs)
    spans = _split([_session(j).n for j in jobs])
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
            _session(j).coverage.extend(StepCoverage([0] * (b - a), alive) for _ in ver.level_sizes)
        res.append(part)
    return res


def _run_one(ver: LocalVerifier, job) -> Any:
    try:
        if not isinstance(job, (BeamJob, ExpandJob)):
            raise TypeError(f"not a verifier job: {type(job).__name__}")
        sess = _session(job)
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
