"""The drafter service: a thin adapter over the core drafters.

It follows the catalogue: on every new item-set version the new rows are
embedded (text, for the retrieval drafter; SID, for the self-drafter) and
added to the faiss indexes, without a restart. Drafting runs on one compute
thread; requests name the catalogue version they work on.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from prometheus_client import Counter, Gauge
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specrec.bundle import Bundle, sid_space_fingerprint
from specrec.drafters.base import DraftRequest as CoreDraftRequest
from specrec.ids.embed import TextEmbedder
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import InvalidArgument, handle_errors, require
from specrec_rpc.processes import Processes
from specrec_rpc.server import Service, make_channel
from specrec_rpc.settings import ServiceSettings
from specrec_rpc.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

INDEXED = Gauge("specrec_drafter_indexed_items", "Catalogue rows in the drafter index", ["mode"])
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


class DrafterService(Service):
    name = "drafter"
    grpc_services = ("specrec.v1.Drafter",)

    def __init__(self, settings: DrafterSettings):
        super().__init__(settings)
        self.s = settings
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self.drafters: dict = {}
        self.embedder = TextEmbedder()

    async def start(self) -> None:
        torch.set_num_threads(self.s.threads)
        self.bundle = await asyncio.to_thread(Bundle.load, self.s.bundle)
        self.channel = make_channel(self.s.itemset_addr, self.s, aio=True)
        # a catalogue of another bundle (another SID space) is refused: the service waits NOT_SERVING for its own
        self.sid_space = sid_space_fingerprint(self.s.bundle)
        self.catalogue = CatalogueWatcher(self.channel, expect_bundle=self.sid_space,
                                          min_reload_s=self.s.catalogue_min_reload_s)
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
                self.executor, d.draft,
                [CoreDraftRequest(rows, 10), CoreDraftRequest(rows, 5, snap.itemset.sids[rows[:2], :1])],
            )
        backends = {m: d.warmup() for m, d in self.drafters.items() if hasattr(d, "warmup")}
        if backends:
            self.log.info("drafter backends", **backends)  # SASRec's graph, or the model where it could not be built
        if self.default_mode not in self.drafters:
            raise ValueError(f"default mode {self.default_mode!r} is not available (have {sorted(self.drafters)})")

    def _build(self, snap: Snapshot) -> None:
        """Drafters for the bundle's rows, then the snapshot's extra rows."""
        b = self.bundle
        base = b.itemset
        n0 = len(b.catalogue)
        if b.retrieval is not None and b.text_emb is not None and self.s.text_embedder:
            self.drafters["retrieval"] = b.drafter("retrieval", base, text_share=self.s.text_share,
                                                   unseen_share=self.s.unseen_share)
        if b.self_draft is not None:
            self.drafters["self"] = b.drafter("self", base)
        if b.sasrec is not None:  # its unseen share from the retrieval drafter's text part (which follows new items)
            self.drafters["sasrec"] = b.drafter("sasrec", base, unseen_share=self.s.unseen_share,
                                                unseen_source=self.drafters.get("retrieval"))
        if not self.drafters:
            raise ValueError(f"bundle {self.s.bundle} has no drafters (run `specrec train-drafters`)")
        self.default_mode = self.s.default_mode or b.default_drafter() or ""
        self._rows = n0
        self._follow(snap)

    def _embed_new(self, snap: Snapshot) -> np.ndarray | None:
        """Text embeddings of the rows added since the last version (None when there are none, or no
        retrieval drafter reads them)."""
        extra = range(self._rows, snap.itemset.n_rows)
        if "retrieval" not in self.drafters or not len(extra):
            return None
        return self.embedder([snap.texts[r] or snap.titles[r] or snap.ids[r] for r in extra])

    def _follow(self, snap: Snapshot, new_emb: np.ndarray | None = None) -> None:
        """Index rows added since the last version (their text embeddings in ``new_emb``, computed by
        :meth:`_embed_new` when not given); point the drafters at the new snapshot."""
        if new_emb is None:
            new_emb = self._embed_new(snap)
        extra = snap.itemset.n_rows - self._rows
        for mode, d in self.drafters.items():
            if mode == "retrieval":
                d.add_items(snap.itemset, new_emb) if new_emb is not None else d.set_itemset(snap.itemset)
            else:
                d.add_items(snap.itemset) if extra > 0 else d.set_itemset(snap.itemset)
            INDEXED.labels(mode).set(len(d.vectors))
        self._rows = max(self._rows, snap.itemset.n_rows)  # rows indexed so far (a snapshot may end earlier)
        self.snap = snap

    async def _on_version(self, snap: Snapshot, old) -> None:
        # the text encoder runs beside the drafts (tens of ms for a few texts), only the index update waits
        # for the draft thread
        new_emb = await asyncio.to_thread(self._embed_new, snap)
        await asyncio.get_running_loop().run_in_executor(self.executor, self._follow, snap, new_emb)
        self.log.info("drafter follows catalogue", version=snap.version, rows=snap.itemset.n_rows)

    async def stop(self) -> None:
        await self.catalogue.stop()
        await self.channel.close()
        self.executor.shutdown(wait=True)

    def add_to_server(self, server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(Servicer(self), server)


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
        core = []
        for qi, q in enumerate(request.queries):
            f = f"queries[{qi}]"
            require(1 <= q.n <= s.max_n, f"{f}.n", f"must be 1..{s.max_n}")
            require(len(q.history) <= s.max_history, f"{f}.history", f"at most {s.max_history} items")
            hist = np.array([snap.index[i] for i in q.history if i in snap.index], dtype=np.int64)
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
            exclude = frozenset(snap.index[i] for i in q.exclude if i in snap.index)
            core.append(CoreDraftRequest(hist, q.n, prefixes, exclude))
        drafter = svc.drafters[mode]
        drafts = await asyncio.get_running_loop().run_in_executor(svc.executor, drafter.draft, core)
        snap = svc.snap  # may have moved on while drafting: it knows every row drafted
        ids, sids = snap.ids, snap.itemset.sids
        out = []
        for d in drafts:
            rows = d.items.tolist()
            DRAFTED.labels(mode).inc(len(rows))
            out.append(drafter_pb2.Draft(
                item_ids=[ids[r] for r in rows], scores=d.scores.tolist(),
                sids=[common_pb2.Sid(codes=sids[r].tolist()) for r in rows] if request.with_sids else None))
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
                    weights=fusion.combiner.flat())),
            modes=sorted(svc.drafters), sid_space=svc.sid_space)
