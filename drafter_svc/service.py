"""The drafter service: a thin adapter over the core drafters.

It follows the catalogue: on every new item-set version the drafters point at it
at once, and the new rows are embedded (text, for the retrieval drafter; SID,
for the self-drafter) and added to the faiss indexes in the background, in
chunks, without a restart. The service serves as soon as the bundle's rows are
indexed: a catalogue of ten million items starts in seconds, its rows past the
bundle's drafted once indexed (progress in the log and in
``specrec_drafter_pending_items``). ``modes`` chooses the drafters loaded (the
SASRec drafter indexes nothing: it drafts the rows it was trained on). Drafting
runs on one compute thread, and so do the index appends, between drafts;
requests name the catalogue version they work on. A draft runs on the event loop's own thread when nothing holds
the drafters (``draft_on_loop``): no hand-off to the draft thread and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from prometheus_client import Counter, Gauge
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from specrec.bundle import Bundle, sid_space_fingerprint
from specrec.drafters.base import DraftRequest as CoreDraftRequest
from specrec.drafters.retrieval import RetrievalDrafter
from specrec.drafters.self_draft import SelfDrafter
from specrec.drafters.vector import Batch, VectorDrafter
from specrec.ids.embed import TextEmbedder
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import InvalidArgument, handle_errors, require
from specrec_rpc.processes import Processes
from specrec_rpc.rowindex import rows_of
from specrec_rpc.server import Service, make_channel
from specrec_rpc.settings import ServiceSettings
from specrec_rpc.tensors import TensorError, from_msg, to_msg
from specrec_rpc.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

INDEXED = Gauge("specrec_drafter_indexed_items", "Catalogue rows in the drafter index", ["mode"])
PENDING = Gauge("specrec_drafter_pending_items", "Catalogue rows not indexed yet (not drafted until they are)",
                ["mode"])
MODES = ("sasrec", "retrieval", "self")
DRAFTED = Counter("specrec_drafter_candidates", "Candidates returned", ["mode"])


class DrafterSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECREC_DRAFTER_", extra="ignore")

    port: int = Field(50052, description="gRPC port")
    metrics_port: int = Field(9102, description="Prometheus port (0 = off)")
    bundle: Path = Field(Path("bundles/beauty-loo"), description="trained bundle directory (with drafters)")
    itemset_addr: str = Field("127.0.0.1:50051", description="item-set service address")
    default_mode: str = Field("", description="'sasrec', 'retrieval' or 'self'; empty: the bundle's best (sasrec "
                              "where it has a SASRec with a fusion chosen by `specrec tune-fusion`, else retrieval, "
                              "else self)")
    threads: int = Field(1, description="torch intra-op threads")
    processes: Processes = Field(0, ge=0, le=1024, description="drafter processes sharing the port (each loads the "
                                 "bundle and follows the catalogue; the kernel spreads connections over them); 0 or "
                                 "'auto': one per 6 usable cores (affinity, capped by the cgroup's CPU quota), at "
                                 "least one (specrec_rpc/processes.py)")
    max_n: int = Field(1000, description="most candidates one query may ask for")
    max_queries: int = Field(256, description="most queries per call")
    max_history: int = Field(1000, description="most history items per query")
    text_share: float | None = Field(None, ge=0.0, le=1.0, description="the retrieval drafter's share of drafts by "
                                     "text similarity among all items (unset: the bundle's, else 0)")
    unseen_share: float | None = Field(None, ge=0.0, le=1.0, description="its share of drafts by text similarity "
                                       "among the unseen items: items with no training interactions, such as the "
                                       "ones upserted since (unset: the bundle's, else 0)")
    text_embedder: bool = Field(True, description="serve the retrieval drafter, which loads the text embedder "
                                "(all-MiniLM-L6-v2, 88 MB) at start to embed the texts of items upserted since the "
                                "bundle; off (a machine without that model): the other drafters serve, SASRec's unseen "
                                "share drafted by none")
    modes: str = Field("", description="the drafters to load, comma-separated ('sasrec', 'retrieval', 'self'; "
                       "e.g. 'sasrec' for a catalogue of millions: it indexes nothing); a mode not loaded is refused "
                       "(INVALID_ARGUMENT, `mode`). Empty: every mode the bundle has. Without 'retrieval' SASRec's "
                       "unseen share is drafted by none. The retrieval and self drafters index the rows past the "
                       "bundle's in the background (``index_chunk`` at a time, between drafts): a row is drafted "
                       "once indexed; an item with neither text nor title is not indexed by retrieval (nothing to "
                       "read: never drafted by it), the self-drafter drafts it from its SID")
    index_chunk: int = Field(4096, ge=1, le=1_000_000, description="rows embedded and indexed per background step "
                             "(each step's append waits for the draft in progress; a draft waits at most one append)")
    draft_on_loop: bool = Field(True, description="draft on the event loop's own thread when no append is under way "
                                "(no hand-off to the draft thread and back: a draft is about half a millisecond; "
                                "nothing else runs on the loop meanwhile); off: every draft on the draft thread")

    @field_validator("modes")
    @classmethod
    def _modes(cls, v: str) -> str:
        names = [m.strip() for m in v.split(",") if m.strip()]
        bad = [m for m in names if m not in MODES]
        if bad:
            raise ValueError(f"unknown drafter mode(s) {bad} (expected some of {list(MODES)})")
        return ",".join(dict.fromkeys(names))


class DrafterService(Service):
    name = "drafter"
    grpc_services = ("specrec.v1.Drafter",)

    def __init__(self, settings: DrafterSettings):
        super().__init__(settings)
        self.s = settings
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        # held by whatever reads or changes the drafters: a draft (on the loop or the draft thread), an append, a
        # new version followed; the draft thread runs one at a time, the loop drafts only when it is free
        self.lock = threading.Lock()
        self.drafters: dict = {}
        self.embedder = TextEmbedder()
        self._wake = asyncio.Event()  # new rows to index
        self._indexer: asyncio.Task | None = None

    async def start(self) -> None:
        torch.set_num_threads(self.s.threads)
        self.bundle = await asyncio.to_thread(Bundle.load, self.s.bundle)
        self.channel = make_channel(self.s.itemset_addr, self.s, aio=True)
        # a catalogue of another bundle (another SID space) is refused: the service waits NOT_SERVING for its own
        self.sid_space = sid_space_fingerprint(self.s.bundle)
        # the drafters read the SID order (a prefix's items), never the trie: none is built
        self.catalogue = CatalogueWatcher(self.channel, expect_bundle=self.sid_space,
                                          min_reload_s=self.s.catalogue_min_reload_s, trie=False)
        snap = await self.catalogue.start()
        await asyncio.to_thread(self._build, snap)
        if "retrieval" in self.drafters:  # it embeds the texts of new items
            await asyncio.to_thread(self.embedder.load)
        self.catalogue.listeners.append(self._on_version)
        # warm up every mode, on the draft thread (a version followed meanwhile runs there too, never beside it)
        loop = asyncio.get_running_loop()
        for d in self.drafters.values():
            rows = np.nonzero(snap.itemset.active)[0][:5]
            await loop.run_in_executor(
                self.executor, self.locked, d.draft,
                [CoreDraftRequest(rows, 10), CoreDraftRequest(rows, 5, snap.itemset.sids[rows[:2], :1])],
            )
        backends = {m: d.warmup() for m, d in self.drafters.items() if hasattr(d, "warmup")}
        if backends:
            self.log.info("drafter backends", **backends)  # SASRec's graph, or the model where it could not be built
        if self.default_mode not in self.drafters:
            raise ValueError(f"default mode {self.default_mode!r} is not available (have {sorted(self.drafters)})")
        self.log.info("drafter serving", modes=sorted(self.drafters), default_mode=self.default_mode,
                      rows=snap.itemset.n_rows, pending={m: d.pending() for m, d in self._indexed_modes().items()})
        self._indexer = asyncio.create_task(self._index_loop())  # the rows past the bundle's, from now on
        self._wake.set()

    def _build(self, snap: Snapshot) -> None:
        """Drafters for the bundle's rows (the ``modes`` asked for, of those the bundle has), pointed at the
        snapshot: its rows past the bundle's are pending, for the background indexer."""
        b = self.bundle
        base = b.itemset
        have = {"retrieval": b.retrieval is not None and b.text_emb is not None and self.s.text_embedder,
                "self": b.self_draft is not None, "sasrec": b.sasrec is not None}
        want = [m for m in self.s.modes.split(",") if m]
        missing = [m for m in want if not have[m]]
        if missing:
            why = {"retrieval": "a retrieval drafter and text embeddings (and text_embedder on)",
                   "self": "a self-draft head", "sasrec": "a SASRec"}
            raise ValueError(f"modes: {missing} not in bundle {self.s.bundle} (each needs "
                             + "; ".join(f"{m}: {why[m]}" for m in missing) + ")")
        load = set(want) if want else {m for m, ok in have.items() if ok}
        if "retrieval" in load:
            self.drafters["retrieval"] = b.drafter("retrieval", base, text_share=self.s.text_share,
                                                   unseen_share=self.s.unseen_share)
        if "self" in load:
            self.drafters["self"] = b.drafter("self", base)
        if "sasrec" in load:  # its unseen share from the retrieval drafter's text part (which follows new items)
            self.drafters["sasrec"] = b.drafter("sasrec", base, unseen_share=self.s.unseen_share,
                                                unseen_source=self.drafters.get("retrieval"))
        if not self.drafters:
            raise ValueError(f"bundle {self.s.bundle} has no drafters (run `specrec train-drafters`)")
        best = b.default_drafter() or ""
        if not self.s.default_mode and want and best not in self.drafters:
            best = want[0]  # the bundle's best is not loaded: the first mode asked for
        self.default_mode = self.s.default_mode or best
        self._follow(snap)

    def _indexed_modes(self) -> dict[str, VectorDrafter]:
        """The drafters with an index of their own (the rows they draft must be embedded first)."""
        return {m: d for m, d in self.drafters.items() if isinstance(d, VectorDrafter)}

    def _follow(self, snap: Snapshot) -> None:
        """Point the drafters at ``snap`` (on the draft thread): its rows not indexed yet are not drafted until
        the background indexer has added them."""
        for mode, d in self.drafters.items():
            d.set_itemset(snap.itemset)
            INDEXED.labels(mode).set(len(d.vectors))
            PENDING.labels(mode).set(d.pending() if isinstance(d, VectorDrafter) else 0)
        self.snap = snap

    async def _on_version(self, snap: Snapshot, old) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self.locked, self._follow, snap)
        self._wake.set()
        self.log.info("drafter follows catalogue", version=snap.version, rows=snap.itemset.n_rows)

    def _encode(self, d: VectorDrafter, snap: Snapshot, stop: int) -> Batch:
        """The next rows of ``d`` up to ``stop``, embedded (beside the drafts). The retrieval drafter reads an
        item's text, else its title; an item with neither is not indexed (never drafted by it)."""
        if isinstance(d, SelfDrafter):  # from SIDs
            return d.encode(snap.itemset, stop)
        assert isinstance(d, RetrievalDrafter)
        start = d.indexed
        texts = [snap.texts[r] or snap.titles[r] for r in range(start, stop)]
        has = np.array([bool(t) for t in texts], bool)
        with_text = [t for t in texts if t]
        emb = self.embedder(with_text) if with_text else np.zeros((0, d.text_emb.shape[1]), np.float32)
        return d.encode(emb, start, has)

    async def _index_loop(self) -> None:
        """Index the rows past each drafter's in chunks of ``index_chunk``, round-robin over the modes: embedded
        in a worker thread beside the drafts, appended on the draft thread between them. Woken by every version
        with new rows; logs its progress every 10 s and when a backlog is done."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._index_backlog()
            except Exception:  # noqa: BLE001 - an embedder or index failure: logged, tried again
                self.log.exception("drafter indexing failed; trying again in 5 s")
                await asyncio.sleep(5.0)
                self._wake.set()

    async def _index_backlog(self) -> None:
        """Index every row pending in any mode (rows arriving meanwhile too)."""
        loop = asyncio.get_running_loop()
        chunk = self.s.index_chunk
        modes = self._indexed_modes()
        start = {m: d.indexed for m, d in modes.items()}
        t0 = last = time.monotonic()
        while True:
            snap = self.snap
            todo = {m: d for m, d in modes.items() if d.indexed < snap.itemset.n_rows}
            if not todo:
                break
            for mode, d in todo.items():
                batch = await asyncio.to_thread(self._encode, d, snap,
                                                min(d.indexed + chunk, snap.itemset.n_rows))
                await loop.run_in_executor(self.executor, self.locked, d.extend, batch)
                INDEXED.labels(mode).set(len(d.vectors))
                PENDING.labels(mode).set(d.pending(self.snap.itemset))
            if time.monotonic() - last >= 10.0:
                last = time.monotonic()
                self._log_progress("drafter indexing", modes, start, last - t0)
        if any(d.indexed > start[m] for m, d in modes.items()):
            self._log_progress("drafter indexed", modes, start, time.monotonic() - t0)

    def _log_progress(self, what: str, modes: dict[str, VectorDrafter], start: dict[str, int], s: float) -> None:
        self.log.info(what, seconds=round(s, 1), modes={
            m: {"indexed": d.indexed, "pending": d.pending(self.snap.itemset), "not_drafted": d.skipped,
                "rows_per_s": round((d.indexed - start[m]) / max(s, 1e-9))} for m, d in modes.items()})

    def locked(self, fn, *args):
        """``fn(*args)`` holding :attr:`lock` (on the draft thread)."""
        with self.lock:
            return fn(*args)

    async def draft(self, drafter, requests: list[CoreDraftRequest]) -> list:
        """``drafter``'s drafts of ``requests``: on the loop's thread when the drafters are free
        (``draft_on_loop``), else on the draft thread after what holds them."""
        if self.s.draft_on_loop and self.lock.acquire(blocking=False):
            try:
                return drafter.draft(requests)
            finally:
                self.lock.release()
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.locked, drafter.draft, requests)

    async def stop(self) -> None:
        if self._indexer is not None:
            self._indexer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._indexer
        await self.catalogue.stop()
        await self.channel.close()
        self.executor.shutdown(wait=True)

    def add_to_server(self, server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(Servicer(self), server)


def _rows(m, field: str, snap: Snapshot) -> np.ndarray:
    """Catalogue rows (int32 [n]) a caller resolved in its version, as int64 (rows are never reused, so a row of
    its version is this one's too). A negative row is refused; rows past this drafter's catalogue (items added in
    a version it does not follow yet) are left out, as unknown ids are."""
    try:
        a = from_msg(m, field, dtype="int32", ndim=1)
    except TensorError as e:
        raise InvalidArgument(field, str(e).split(": ", 1)[-1]) from None
    if a.size and int(a.min()) < 0:
        raise InvalidArgument(field, "negative row")
    return a[a < snap.itemset.n_rows].astype(np.int64)


class Servicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, svc: DrafterService):
        self.svc = svc

    @handle_errors
    async def Draft(self, request, context):
        svc, s = self.svc, self.svc.s
        mode = request.mode or svc.default_mode
        if mode not in svc.drafters:
            raise InvalidArgument("mode", f"unknown or unavailable mode {mode!r} (have {sorted(svc.drafters)})")
        snap = svc.snap  # the drafter answers from its current version (rows and ids are stable across versions)
        require(1 <= len(request.queries) <= s.max_queries, "queries", f"1..{s.max_queries} queries")
        L = len(snap.level_sizes)
        core, answer_rows = [], []
        for qi, q in enumerate(request.queries):
            f = f"queries[{qi}]"
            require(1 <= q.n <= s.max_n, f"{f}.n", f"must be 1..{s.max_n}")
            require(len(q.history) <= s.max_history, f"{f}.history", f"at most {s.max_history} items")
            by_rows = q.HasField("history_rows")
            if by_rows:  # the caller resolved them in its version: bounds checked, nothing more
                require(len(q.history_rows.shape) == 1 and 0 < q.history_rows.shape[0] <= s.max_history,
                        f"{f}.history_rows", f"1..{s.max_history} rows")
                hist = _rows(q.history_rows, f"{f}.history_rows", snap)
                require(len(hist) > 0, f"{f}.history_rows", "no row of the history is in the catalogue")
            else:
                hist = np.array([r for r in rows_of(snap.index, q.history) if r is not None], dtype=np.int64)
                require(len(hist) > 0, f"{f}.history", "no item of the history is in the catalogue")
            prefixes = None
            if q.prefixes:
                lens = {len(p.codes) for p in q.prefixes}
                require(len(lens) == 1, f"{f}.prefixes", "all prefixes must have the same length")
                plen = lens.pop()
                require(1 <= plen < L, f"{f}.prefixes", f"prefix length must be 1..{L - 1}")
                prefixes = np.array([list(p.codes) for p in q.prefixes], dtype=np.int64)
                if (prefixes < 0).any() or (prefixes >= np.asarray(snap.level_sizes[:plen])).any():
                    raise InvalidArgument(f"{f}.prefixes", "code out of range")
            if q.HasField("exclude_rows"):
                exclude = frozenset(_rows(q.exclude_rows, f"{f}.exclude_rows", snap).tolist())
            else:
                exclude = frozenset(r for r in rows_of(snap.index, q.exclude) if r is not None)
            core.append(CoreDraftRequest(hist, q.n, prefixes, exclude))
            answer_rows.append(by_rows)
        drafter = svc.drafters[mode]
        drafts = await svc.draft(drafter, core)
        snap = svc.snap  # may have moved on while drafting: it knows every row drafted
        ids, sids = snap.ids, snap.itemset.sids
        out = []
        drafted = DRAFTED.labels(mode)
        for d, by_rows in zip(drafts, answer_rows):
            drafted.inc(len(d.items))
            with_sids = [common_pb2.Sid(codes=c) for c in sids[d.items].tolist()] if request.with_sids else None
            if by_rows:
                out.append(drafter_pb2.Draft(rows=to_msg(d.items.astype(np.int32)), row_scores=to_msg(d.scores),
                                             sids=with_sids))
            else:
                out.append(drafter_pb2.Draft(item_ids=[ids[r] for r in d.items.tolist()], scores=d.scores.tolist(),
                                             sids=with_sids))
        return drafter_pb2.DraftResponse(drafts=out, version=snap.version, mode=mode)

    @handle_errors
    async def Describe(self, request, context):
        svc = self.svc
        mode = request.mode or svc.default_mode
        if mode not in svc.drafters:
            raise InvalidArgument("mode", f"unknown or unavailable mode {mode!r} (have {sorted(svc.drafters)})")
        drafter = svc.drafters[mode]
        fusion = getattr(drafter, "fusion", None)
        return drafter_pb2.DrafterDescription(
            mode=mode, unseen_share=float(getattr(drafter, "unseen_share", 0.0) or 0.0),
            fusion=None if fusion is None else drafter_pb2.Fusion(
                weight=fusion.weight, norm=fusion.norm, drafts=fusion.drafts, valid_recall=dict(fusion.valid),
                combiner=None if fusion.combiner is None else drafter_pb2.Combiner(
                    features=fusion.combiner.features, inputs=fusion.combiner.inputs, hidden=fusion.combiner.hidden,
                    weights=fusion.combiner.flat()),
                default_list=fusion.default or ""),
            modes=sorted(svc.drafters), sid_space=svc.sid_space)
