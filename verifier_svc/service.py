"""The verifier service: the GR model behind gRPC.

A thin adapter over :class:`specrec.verifier.LocalVerifier`: it converts
protos to core jobs (:class:`~specrec.verifier.jobs.EncodeJob`,
:class:`~specrec.verifier.jobs.ScoreJob`, ...), hands them to one opportunistic
:class:`~.batcher.Batcher` whose batches the core executes
(:class:`specrec.verifier.runner.Runner`), keeps sessions in a
:class:`~.sessions.SessionStore`, and converts results back. A call that
carries a history instead of a session is encoded in the same batch as its
operation. The catalogue (for constrained decoding) follows the item set by
version. A device that fails (a CUDA error, a lost GPU, a batch past the
``hang_s`` watchdog: :mod:`specrec.verifier.device`) ends the batcher and
takes the service out of rotation for good: health NOT_SERVING, every call
UNAVAILABLE with the reason DEVICE_FAILED, so its callers use another replica.

Every whole search of the registry (:data:`specrec.decoding.searches.SEARCHES`) answers one RPC, ``Search``:
the search's name, its widths by name and its tensors by name are checked against the search's declaration and
become one :class:`~specrec.verifier.jobs.SearchJob` (batched by name and widths), whose value goes back as the
search's named tensors (its ``reply``). Nothing here names a search: a new one is served as it is registered.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import torch
from prometheus_client import Gauge

from specrec.bundle import Bundle, sid_space_fingerprint
from specrec.data.histories import history_codes
from specrec.decoding.searches import SEARCHES
from specrec.decoding.searches import Search as WholeSearch
from specrec.verifier import DeviceFailure, LocalVerifier, SelectRule, Session, SessionStateError
from specrec.verifier.jobs import EncodeJob, ExpandJob, ScoreJob, SearchJob, SearchSpec, StepJob
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import (
    FailedPrecondition,
    InvalidArgument,
    Reason,
    Unimplemented,
    handle_errors,
    register,
    require,
)
from specrec_rpc.server import Service, make_channel
from specrec_rpc.tensors import TensorError, from_msg, to_msg
from specrec_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .batcher import Batcher, Expired
from .faults import Faults
from .sessions import Entry, SessionNotFound, SessionStore
from .settings import VerifierSettings, backend_options, computes_on_loop, on_gpu

__all__ = ["VerifierService", "VerifierSettings"]

register(Expired, grpc.StatusCode.DEADLINE_EXCEEDED)  # a job whose caller's deadline passed while it queued
# the session is gone (restart, eviction, expiry): the gateway reads the reason and re-sends the history
register(SessionNotFound, grpc.StatusCode.FAILED_PRECONDITION, reason=Reason.SESSION_LOST)
# the device failed: this replica is out of rotation for good; the caller retries on another one
register(DeviceFailure, grpc.StatusCode.UNAVAILABLE, reason=Reason.DEVICE_FAILED)

NO_DISTILLED = "this verifier has no distilled drafter"
API = 2  # DescribeResponse.api: one Search RPC for every whole search
SERVED = [name for name, search in SEARCHES.items() if search.inside is None]  # what a caller may ask for

SESSIONS = Gauge("specrec_verifier_sessions", "Live encoder sessions")
GRAPH_PRECISION = Gauge("specrec_verifier_graph_precision", "1 for the arithmetic each graph runs in: float32, or the "
                        "precision `specrec export-onnx` chose for this machine on validation users (the searches "
                        "the registry lets leave float32)", ["graph", "precision"])
GRAPHS = Gauge("specrec_verifier_graphs", "CUDA graphs the backend holds (backend cuda: captured per search, widths "
               "and row bucket before SERVING; more afterwards, each by a slow call, in `after_start`)", ["when"])
GRAPH_CAPTURE = Gauge("specrec_verifier_graph_capture_seconds", "Seconds the backend spent capturing its graphs")
GRAPH_MEMORY = Gauge("specrec_verifier_graph_memory_bytes", "Device memory the captured graphs took (their static "
                     "buffers and shared pool)")
DEVICE_FAILED = Gauge("specrec_verifier_device_failed", "1 once the verifier's device failed (a CUDA error, a lost "
                      "device, a batch past the hang_s watchdog): it is out of rotation until it restarts", ["kind"])
for _kind in ("error", "hang"):
    DEVICE_FAILED.labels(_kind)  # at 0 from the start: "no failure" is data, not "no data"


def _deadline(context) -> float | None:
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


class VerifierService(Service):
    name = "verifier"
    grpc_services = ("specrec.v1.Verifier",)

    def __init__(self, settings: VerifierSettings):
        super().__init__(settings)
        self.s = settings
        self.sessions = SessionStore(settings.session_ttl_s, settings.max_sessions)
        self.executor = ThreadPoolExecutor(max_workers=settings.compute_threads, thread_name_prefix="compute")
        self.faults = Faults(settings)

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        s = self.s
        torch.set_num_threads(s.threads)
        self.bundle = await asyncio.to_thread(Bundle.load, s.bundle)
        backend = await asyncio.to_thread(self.bundle.backend, s.backend, **backend_options(s))
        self.log.info("backend", **backend.describe())
        # graph -> its arithmetic (none for eager, which has no graphs)
        self.precision: dict[str, str] = getattr(backend, "graph_precisions", dict)()
        for graph, precision in self.precision.items():
            GRAPH_PRECISION.labels(graph, precision).set(1)
        if s.require_gpu and not on_gpu(backend):
            raise RuntimeError(f"require_gpu is set but the backend runs on {backend.describe()} (backend cuda with "
                               f"device cuda, or onnxruntime-gpu; and give the pod a GPU)")
        self.sid_space = sid_space_fingerprint(s.bundle)
        self.build_info(backend=backend.name, onnx_provider=",".join(getattr(backend, "providers", [])) or "none",
                        bundle=self.sid_space)
        self.local = LocalVerifier(backend, self.bundle.nezha_head, self.bundle.model)
        self.level_sizes = list(self.bundle.cfg.level_sizes)
        self.max_history = self.bundle.cfg.max_history
        self.channel = make_channel(s.itemset_addr, s, aio=True)
        # a catalogue of another bundle (another SID space) is refused: the service waits NOT_SERVING for its own
        vmax = max(self.level_sizes)
        # a new version's search tables are built with it, not by the first request that searches it
        self.catalogue = CatalogueWatcher(self.channel, expect_bundle=self.sid_space,
                                          min_reload_s=s.catalogue_min_reload_s,
                                          prepare=lambda snap: snap.itemset.trie.search_tables(vmax),
                                          index=False)  # it reads rows only: no id index, titles or texts
        await self.catalogue.start()
        on_loop = computes_on_loop(s, backend)
        self.batcher: Batcher = Batcher("verifier", self._compute, None if on_loop else self.executor, s.max_batch,
                                        concurrency=s.compute_threads, hang_s=s.hang_s,
                                        on_failure=self._device_failed)
        self.log.info("compute", on_loop=on_loop, threads=s.threads,
                      compute_threads=1 if on_loop else s.compute_threads)
        self.batcher.start()
        self._gc = asyncio.create_task(self._expire_sessions())
        await self._warmup()
        self.faults.armed = True  # (the warm-up's batches are not counted)
        d = backend.describe()
        if "graphs" in d:  # a backend of captured graphs (cuda): what capturing took, said before SERVING
            self.log.info("graphs captured", **d)
            GRAPHS.labels("warm_up").set(d["graphs"])
            GRAPHS.labels("after_start").set_function(lambda: backend.describe()["captured_after_start"])
            GRAPH_CAPTURE.set(d["capture_s"])
            GRAPH_MEMORY.set(d["graph_memory_mb"] * 2**20)

    def _compute(self, jobs: list) -> list:
        """One batch, on a compute thread (what fault injection makes fail or hang, as a failed GPU would)."""
        self.faults.before_batch()
        return self.local.runner.run(jobs)

    def _device_failed(self, failure: DeviceFailure) -> None:
        """The batcher found the device failed (on the event loop's thread): out of rotation for good."""
        DEVICE_FAILED.labels(failure.kind).set(1)
        self.log.error("device failed", kind=failure.kind, detail=failure.detail, device=self.s.device,
                       backend=self.s.backend)
        self.take_out_of_rotation(failure)

    async def _warmup(self) -> None:
        """Run every path (and every whole-search graph of the configured widths) before SERVING."""
        snap = await self.catalogue.get()  # the current version (start() installed it)
        await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(self.local.backend.warmup, snap.itemset.trie, self.s.warmup_k,
                                             scored=self.bundle.scored_counts(self.s.warmup_k)))
        rows = np.nonzero(snap.itemset.active)[0]
        rng = np.random.default_rng(0)
        # a graph's shapes do not depend on the history's length (it is padded to the window): the shortest and
        # the longest reach every graph and the largest buffers
        for n in sorted({1, self.max_history}):
            h = np.full((1, self.max_history, len(self.level_sizes)), -1, dtype=np.int64)
            h[0, self.max_history - n :] = snap.itemset.sids[rng.choice(rows, size=min(len(rows), n))]
            trie = snap.itemset.trie
            for width in self.s.warmup_k:  # every search the bundle offers, at the widths the registry warms
                for search in SEARCHES.values():
                    if search.inside is None and not search.args and self.lacks(search) is None:
                        for widths in search.warm(width, [2 * width]):
                            await self.batcher.submit(SearchJob(EncodeJob(h), search.name, trie, widths), None)
            sids = torch.from_numpy(snap.itemset.sids[rows[: 2 + 4 * n]])[None]
            await self.batcher.submit(ScoreJob(EncodeJob(h), sids), None)
            for m in self.bundle.scored_counts(self.s.warmup_k):  # specgr ranking by both models: the scoring pass
                cands = torch.from_numpy(snap.itemset.sids[rows[:m]])[None]
                for search in SEARCHES.values():
                    if search.args:
                        job = SearchJob(EncodeJob(h), search.name, None, (), {a: cands for a in search.args})
                        await self.batcher.submit(job, None)
            await self.batcher.submit(ScoreJob(EncodeJob(h), sids, step=SearchSpec(trie, 10)), None)
            await self.batcher.submit(StepJob(EncodeJob(h), SearchSpec(trie, 10)), None)

    def lacks(self, search: WholeSearch) -> str | None:
        """Why this verifier's bundle cannot run ``search`` (a part it lacks), or None."""
        if search.uses_sid_drafter and self.local.backend.drafter is None:
            return "this verifier's bundle has no distilled drafter"
        if search.uses_head and self.local.head is None:
            return "this verifier's bundle has no NEZHA draft head"
        return None

    async def stop(self) -> None:
        self._gc.cancel()
        self.faults.release()
        await self.batcher.stop()
        await self.catalogue.stop()
        await self.channel.close()
        # a hung device's compute thread never ends: not waited for
        self.executor.shutdown(wait=self.batcher.failed is None or self.batcher.failed.kind != "hang")

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.sessions.expire()
            SESSIONS.set(len(self.sessions))

    def add_to_server(self, server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(Servicer(self), server)

    async def run(self, job, context):
        """One job through the batcher, the caller's deadline as the job's."""
        if self.s.fault_delay_ms:  # a slowed verifier, on purpose (fault_delay_ms)
            await asyncio.sleep(self.s.fault_delay_ms / 1000.0)
        try:
            return await self.batcher.submit(job, _deadline(context))
        except SessionStateError as e:
            raise FailedPrecondition(str(e)) from None


def _steps_before(target: Session | EncodeJob) -> int:
    """Beam steps the session had recorded before a call (a session the call encodes had none)."""
    return len(target.coverage) if isinstance(target, Session) else 0


def _steps_since(job, before: int) -> list:
    """The coverage of the beam steps a job took (its session is the one it encoded, if it carried a history)."""
    sess = job.session
    return sess.coverage[before:] if isinstance(sess, Session) else []


def beams_msg(b, session: str = "", coverage=()) -> verifier_pb2.Beams:
    cov = list(coverage)
    shape = (len(cov), -1) if cov else (0, 0)  # a head search has no per-level coverage
    covered = np.asarray([c.covered for c in cov], dtype=np.int32).reshape(shape)
    computed = np.asarray([c.computed for c in cov], dtype=np.int32).reshape(shape)
    return verifier_pb2.Beams(
        codes=to_msg(b.codes),
        scores=to_msg(b.scores.float()),
        token_logp=to_msg(b.token_logp.float()),
        alive=to_msg(b.alive),
        covered=to_msg(covered),
        computed=to_msg(computed),
        session=session,
    )


class Servicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, svc: VerifierService):
        self.svc = svc

    # -- validation -----------------------------------------------------------------------
    def _hist(self, m, field: str) -> np.ndarray:
        try:
            h = from_msg(m, field, dtype="int64", ndim=3)
        except TensorError as e:
            raise InvalidArgument(field, str(e).split(": ", 1)[-1]) from None
        L = len(self.svc.level_sizes)
        require(h.shape[0] >= 1, field, "no histories")
        require(h.shape[0] <= self.svc.s.max_batch * 8, field, f"at most {self.svc.s.max_batch * 8} histories per call")
        require(h.shape[2] == L, field, f"expected {L} codes per item, got {h.shape[2]}")
        require(1 <= h.shape[1] <= self.svc.max_history, field, f"history length must be 1..{self.svc.max_history}")
        if h.shape[1] < self.svc.max_history:  # left-pad to the model's window
            pad = np.full((h.shape[0], self.svc.max_history - h.shape[1], L), -1, dtype=np.int64)
            h = np.concatenate([pad, h], axis=1)
        self._check_codes(h, field, allow_pad=True)
        require(bool((h[:, :, 0] >= 0).any(1).all()), field, "every history needs at least one item")
        return np.ascontiguousarray(h)

    def _check_codes(self, a: np.ndarray, field: str, allow_pad: bool = False) -> None:
        sizes = np.asarray(self.svc.level_sizes[: a.shape[-1]])
        bad = (a >= sizes) | (a < (-1 if allow_pad else 0))
        if bad.any():
            raise InvalidArgument(field, f"code out of range at index {list(map(int, np.argwhere(bad)[0]))}")

    def _codes(self, m, field: str, rows: int, full_len: bool = True) -> torch.Tensor:
        try:
            a = from_msg(m, field, dtype="int64", ndim=3)
        except TensorError as e:
            raise InvalidArgument(field, str(e).split(": ", 1)[-1]) from None
        L = len(self.svc.level_sizes)
        require(a.shape[0] == rows, field, f"expected {rows} rows (the session's), got {a.shape[0]}")
        require(1 <= a.shape[1] <= self.svc.s.max_candidates, field, f"1..{self.svc.s.max_candidates} per row")
        if full_len:
            require(a.shape[2] == L, field, f"expected {L} codes, got {a.shape[2]}")
        else:
            require(0 <= a.shape[2] < L, field, f"prefix length must be 0..{L - 1}")
        self._check_codes(a, field)
        return torch.from_numpy(np.array(a))

    def _row_codes(self, m, field: str, rows: int, snap: Snapshot) -> torch.Tensor:
        """Candidates given as catalogue rows [R, M] -> their SIDs [R, M, L] from this verifier's catalogue."""
        a = self._rows(m, field, snap, 2)
        require(a.shape[0] == rows, field, f"expected {rows} rows (the session's), got {a.shape[0]}")
        require(1 <= a.shape[1] <= self.svc.s.max_candidates, field, f"1..{self.svc.s.max_candidates} per row")
        return torch.from_numpy(snap.itemset.sids[a])

    def _width(self, width: int, field: str = "width") -> int:
        require(1 <= width <= self.svc.s.max_width, field, f"must be 1..{self.svc.s.max_width}")
        return width

    @staticmethod
    def _rule(m, field: str = "rule") -> SelectRule | None:
        if not m.kind or m.kind == "exact":
            return None
        require(m.kind == "relaxed", f"{field}.kind", f"'exact' or 'relaxed', not {m.kind!r}")
        require(0.0 <= m.threshold <= 1.0, f"{field}.threshold", "must be within [0, 1]")
        require(1 <= m.top_k <= 4096, f"{field}.top_k", "must be 1..4096")
        return SelectRule("relaxed", float(m.threshold), int(m.top_k))

    def _spec(self, snap: Snapshot, ref, rows: int, m, field: str = "") -> SearchSpec:
        """The beam search a call asks for (``m`` holds its width and rule; ``field`` their message's name)."""
        at = f"{field}." if field else ""
        return SearchSpec(
            self._trie(snap, ref, rows), self._width(m.width, f"{at}width"), self._rule(m.rule, f"{at}rule")
        )

    def _trie(self, snap: Snapshot, ref, rows: int):
        """The catalogue's trie, or this call's view of it without ``ref.exclude_sids``."""
        if not ref.HasField("exclude_sids"):
            return snap.itemset.trie
        field = "ref.exclude_sids"
        try:
            a = from_msg(ref.exclude_sids, field, dtype="int64", ndim=2)
        except TensorError as e:
            raise InvalidArgument(field, str(e).split(": ", 1)[-1]) from None
        L = len(self.svc.level_sizes)
        require(a.shape[1] == L, field, f"expected {L} codes per SID, got {a.shape[1]}")
        require(a.shape[0] <= 4096, field, "at most 4096 SIDs")
        require(rows == 1, field, f"needs a session of one row, this one has {rows}")
        self._check_codes(a[None], field)
        return snap.itemset.trie.excluding(np.array(a))

    def _rows(self, m, field: str, snap: Snapshot, ndim: int, pad: bool = False) -> np.ndarray:
        """Catalogue rows of ``snap`` (int32, ``ndim`` dimensions; -1 where ``pad``): their bounds checked, nothing
        more (the caller resolved them in this version; rows are never reused)."""
        try:
            a = from_msg(m, field, dtype="int32", ndim=ndim)
        except TensorError as e:
            raise InvalidArgument(field, str(e).split(": ", 1)[-1]) from None
        if a.size and (int(a.max()) >= snap.itemset.n_rows or int(a.min()) < (-1 if pad else 0)):
            raise InvalidArgument(field, f"row out of range (catalogue version {snap.version} has "
                                         f"{snap.itemset.n_rows} rows)")
        return a

    def _history_rows(self, m, snap: Snapshot, field: str = "ref.history_rows") -> np.ndarray:
        """``m.history_rows`` [R, H] -> the model's input [R, window, L]: the rows' SIDs from this verifier's
        copy of the catalogue, left-padded with rows of -1."""
        rows = self._rows(m.history_rows, field, snap, 2, pad=True)
        require(1 <= rows.shape[0] <= self.svc.s.max_batch * 8, field,
                f"1..{self.svc.s.max_batch * 8} histories per call")
        require(1 <= rows.shape[1] <= self.svc.max_history, field, f"history length must be 1..{self.svc.max_history}")
        require(bool((rows >= 0).any(1).all()), field, "every history needs at least one item")
        return history_codes(rows, self.svc.max_history, snap.itemset.sids)

    async def _ref(self, ref) -> tuple[Session | EncodeJob, Snapshot, int]:
        """The session a call works on: an existing one, or an :class:`EncodeJob` to run with the call."""
        if ref.session:
            e: Entry = self.svc.sessions.get(ref.session)  # SessionNotFound: FAILED_PRECONDITION, SESSION_LOST
            return e.session, e.snap, e.session.n
        if ref.HasField("history_rows"):
            snap = await self.svc.catalogue.get(ref.version)
            h = self._history_rows(ref, snap)
        else:
            require(ref.HasField("history_sids"), "ref", "needs a session, history_rows or history_sids")
            h = self._hist(ref.history_sids, "ref.history_sids")
            snap = await self.svc.catalogue.get(ref.version)
        return EncodeJob(h), snap, len(h)

    def _session_id(self, job, ref, snap: Snapshot) -> str:
        """The id of the session the job worked on (a session the job encoded is registered when kept; one the
        call ends, ``ref.end``, is forgotten now: "")."""
        if ref.session:
            if ref.end:
                self.svc.sessions.pop(ref.session)
                return ""
            return ref.session
        return self.svc.sessions.add(job.session, snap) if ref.keep else ""

    # -- RPCs ---------------------------------------------------------------------------------
    @handle_errors
    async def Encode(self, request, context):
        snap = await self.svc.catalogue.get(request.version)
        h = (self._history_rows(request, snap, "history_rows") if request.HasField("history_rows")
             else self._hist(request.history_sids, "history_sids"))
        sess = await self.svc.run(EncodeJob(h), context)
        return verifier_pb2.EncodeResponse(session=self.svc.sessions.add(sess, snap), version=snap.version, n=sess.n)

    @handle_errors
    async def Score(self, request, context):
        target, snap, n = await self._ref(request.ref)
        step = self._spec(snap, request.ref, n, request.step, "step") if request.HasField("step") else None
        job = ScoreJob(target, self._codes(request.sids, "sids", n), request.full, request.with_frontier, step)
        before = _steps_before(target)
        out = await self.svc.run(job, context)
        sc, beams = out if step is not None else (out, None)
        return verifier_pb2.ScoreResponse(
            token_logp=to_msg(sc.token_logp), full=[to_msg(f) for f in sc.full or []],
            session=self._session_id(job, request.ref, snap),
            beams=None if beams is None else beams_msg(beams, coverage=_steps_since(job, before)))

    @handle_errors
    async def Expand(self, request, context):
        target, snap, n = await self._ref(request.ref)
        if request.head and self.svc.local.head is None:
            raise Unimplemented("this verifier's bundle has no NEZHA draft head")
        job = ExpandJob(target, self._codes(request.prefixes, "prefixes", n, full_len=False), request.head)
        out = await self.svc.run(job, context)
        out = out if isinstance(out, list) else [out]
        return verifier_pb2.ExpandResponse(
            logp=[to_msg(x) for x in out], session=self._session_id(job, request.ref, snap)
        )

    @handle_errors
    async def BeamStep(self, request, context):
        """One more level of the session's beam search (the first starts it): the beams and the step's coverage."""
        target, snap, n = await self._ref(request.ref)
        job = StepJob(target, self._spec(snap, request.ref, n, request))
        before = _steps_before(target)
        beams = await self.svc.run(job, context)
        return beams_msg(beams, self._session_id(job, request.ref, snap), _steps_since(job, before))

    @handle_errors
    async def Search(self, request, context):
        """Whole search ``request.search`` of the registry, checked against its declaration, in one job."""
        search = SEARCHES.get(request.search)
        if search is None or search.inside is not None:
            raise InvalidArgument("search", f"one of {', '.join(SERVED)}, not {request.search!r}")
        lacks = self.svc.lacks(search)
        if lacks is not None:
            raise Unimplemented(lacks)
        target, snap, n = await self._ref(request.ref)
        widths = self._widths(search, request.widths)
        for kind, given in (("tensors", request.tensors), ("row_tensors", request.row_tensors)):
            for name in given:
                require(name in search.args, f"{kind}[{name}]", f"{search.name} takes {list(search.args) or 'none'}")
        args = {}
        for name in search.args:
            if name in request.row_tensors:
                require(name not in request.tensors, f"row_tensors[{name}]", "given in tensors too")
                args[name] = self._row_codes(request.row_tensors[name], f"row_tensors[{name}]", n, snap)
            else:
                require(name in request.tensors, f"tensors[{name}]", f"{search.name} needs it")
                args[name] = self._codes(request.tensors[name], f"tensors[{name}]", n)
        rule = None
        if request.HasField("rule"):
            require(search.steps, "rule", f"{search.name} has no beam steps to pick")
            rule = self._rule(request.rule)
        trie = self._trie(snap, request.ref, n) if search.tables else None
        job = SearchJob(target, search.name, trie, widths, args, rule)
        before = _steps_before(target)
        value = await self.svc.run(job, context)
        if value is None:  # the backend could not run it (no distilled drafter)
            raise FailedPrecondition(NO_DISTILLED)
        reply = verifier_pb2.SearchReply(tensors={k: to_msg(v) for k, v in search.reply(value).items()},
                                         session=self._session_id(job, request.ref, snap))
        steps = _steps_since(job, before)
        if steps:
            reply.covered.CopyFrom(to_msg(np.asarray([c.covered for c in steps], dtype=np.int32)))
            reply.computed.CopyFrom(to_msg(np.asarray([c.computed for c in steps], dtype=np.int32)))
        return reply

    def _widths(self, search: WholeSearch, widths) -> tuple[int, ...]:
        """A search's static widths, in the order the registry names them."""
        for name in widths:
            require(name in search.widths, f"widths[{name}]", f"{search.name} takes {list(search.widths) or 'none'}")
        for name in search.widths:
            require(name in widths, f"widths[{name}]", f"{search.name} needs it")
            require(1 <= widths[name] <= self.svc.s.max_width, f"widths[{name}]", f"must be 1..{self.svc.s.max_width}")
        return tuple(int(widths[name]) for name in search.widths)

    @handle_errors
    async def Describe(self, request, context):
        parts = self.svc.local.parts()
        return verifier_pb2.DescribeResponse(distilled_drafter=parts.distilled_drafter, draft_head=parts.draft_head,
                                             sid_space=self.svc.sid_space, precision=self.svc.precision, api=API)

    @handle_errors
    async def Release(self, request, context):
        self.svc.sessions.pop(request.session)
        return verifier_pb2.ReleaseResponse()
