"""The verifier service: the GR model behind gRPC.

A thin adapter over :class:`specrec.verifier.LocalVerifier`: sessions hold
the encoder output per request (TTL, bounded), Encode/Score/BeamSearch calls
from concurrent requests are batched dynamically (:mod:`.batcher`), and every
computation runs on one compute thread so the event loop stays responsive.
The catalogue (for constrained decoding) follows the item set by version.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
from prometheus_client import Gauge
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specrec.bundle import Bundle
from specrec.decoding.beam import Beams, beam_search
from specrec.decoding.scoring import score_sids
from specrec.models.tiger import EncoderState
from specrec.verifier import LocalVerifier, Session, LocalState
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import FailedPrecondition, InvalidArgument, handle_errors, require
from specrec_rpc.server import Service, channel_options
from specrec_rpc.settings import ServiceSettings
from specrec_rpc.tensors import TensorError, from_msg, to_msg
from specrec_rpc.v1 import verifier_pb2, verifier_pb2_grpc

from .batcher import Batcher, Expired

SESSIONS = Gauge("specrec_verifier_sessions", "Live encoder sessions")


class VerifierSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECREC_VERIFIER_", extra="ignore")

    port: int = Field(50053, description="gRPC port")
    metrics_port: int = Field(9103, description="Prometheus port (0 = off)")
    bundle: Path = Field(Path("bundles/beauty-loo"), description="trained bundle directory")
    backend: str = Field("torch", description="'torch', or 'onnx' (ONNX Runtime: CUDA provider when present, else CPU)")
    onnx_dir: Path | None = Field(None, description="exported ONNX model (default: exported at start into a temp dir)")
    itemset_addr: str = Field("127.0.0.1:50051", description="item-set service address")
    threads: int = Field(2, description="torch / ONNX Runtime intra-op threads")
    max_batch: int = Field(32, description="largest dynamic batch (requests)")
    max_wait_ms: float = Field(1.0, description="longest wait for a batch to fill, ms")
    session_ttl_s: float = Field(30.0, description="an idle session is forgotten after this many seconds")
    max_sessions: int = Field(20_000, description="at most this many sessions (oldest evicted first)")
    max_width: int = Field(1000, description="largest beam width accepted")
    max_candidates: int = Field(4096, description="largest number of candidates per session row in one Score")
    warmup_requests: int = Field(8, description="requests run through every path before reporting SERVING")


@dataclass
class Entry:
    session: Session
    snap: Snapshot
    touched: float


def _deadline(context) -> float | None:
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


class VerifierService(Service):
    name = "verifier"
    grpc_services = ("specrec.v1.Verifier",)

    def __init__(self, settings: VerifierSettings):
        super().__init__(settings)
        self.s = settings
        self.sessions: OrderedDict[str, Entry] = OrderedDict()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        s = self.s
        torch.set_num_threads(s.threads)
        self.bundle = await asyncio.to_thread(Bundle.load, s.bundle)
        model = self.bundle.model
        if s.backend == "onnx":
            from specrec.export.onnx import OrtTiger, export_onnx

            onnx_dir = s.onnx_dir
            if onnx_dir is None or not (Path(onnx_dir) / "decoder.onnx").exists():
                import tempfile

                onnx_dir = Path(onnx_dir or tempfile.mkdtemp(prefix="specrec-onnx-"))
                await asyncio.to_thread(export_onnx, self.bundle.model, onnx_dir)
            model = OrtTiger(onnx_dir, threads=s.threads)
            self.log.info("onnx runtime", providers=model.providers)
        elif s.backend != "torch":
            raise ValueError(f"backend must be 'torch' or 'onnx', not {s.backend!r}")
        self.local = LocalVerifier(model, self.bundle.nezha_head, self.bundle.model)
        self.level_sizes = list(self.bundle.cfg.level_sizes)
        self.max_history = self.bundle.cfg.max_history
        self.channel = grpc.aio.insecure_channel(s.itemset_addr, options=channel_options(s))
        self.catalogue = CatalogueWatcher(self.channel)
        await self.catalogue.start()
        self.batchers = {
            "encode": Batcher("encode", self._encode_batch, self.executor, s.max_batch, s.max_wait_ms),
            "score": Batcher("score", self._score_batch, self.executor, s.max_batch, s.max_wait_ms),
            "beam_search": Batcher("beam_search", self._beam_batch, self.executor, s.max_batch, s.max_wait_ms),
        }
        for b in self.batchers.values():
            b.start()
        self._gc = asyncio.create_task(self._expire_sessions())
        await self._warmup()

    async def _warmup(self) -> None:
        """Run every path once so the first real request pays no one-time costs."""
        snap = self.catalogue.current
        rng = np.random.default_rng(0)
        rows = np.nonzero(snap.itemset.active)[0]
        for i in range(self.s.warmup_requests):
            hist = snap.itemset.sids[rng.choice(rows, size=min(len(rows), 1 + i % self.max_history))]
            h = np.full((1, self.max_history, len(self.level_sizes)), -1, dtype=np.int64)
            h[0, self.max_history - len(hist):] = hist
            enc = await self.batchers["encode"].submit((h,), None)
            await self.batchers["score"].submit((enc, torch.from_numpy(snap.itemset.sids[rows[:8]])[None], False), None)
            await self.batchers["beam_search"].submit((h, 10, snap), None)
            if self.local.head is not None:
                sess = Session(1, LocalState(enc))
                await asyncio.get_running_loop().run_in_executor(self.executor, self.local.head_beams, sess, snap.itemset.trie, 10)

    async def stop(self) -> None:
        self._gc.cancel()
        for b in self.batchers.values():
            await b.stop()
        await self.catalogue.stop()
        await self.channel.close()
        self.executor.shutdown(wait=True)

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.s.session_ttl_s
            for sid in [k for k, e in self.sessions.items() if e.touched < cutoff]:
                self.sessions.pop(sid, None)
            SESSIONS.set(len(self.sessions))

    def add_to_server(self, server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(Servicer(self), server)

    # -- batched computations (compute thread) -----------------------------------------
    @torch.inference_mode()
    def _encode_batch(self, payloads):
        hists = [p[0] for p in payloads]
        enc = self.local.model.encode(torch.from_numpy(np.concatenate(hists)))
        out, start = [], 0
        for h in hists:
            out.append(enc.select(torch.arange(start, start + len(h))))
            start += len(h)
        return out

    @torch.inference_mode()
    def _score_batch(self, payloads):
        groups: dict[bool, list[int]] = {}
        for i, p in enumerate(payloads):
            groups.setdefault(p[2], []).append(i)
        out: list = [None] * len(payloads)
        for full, idx in groups.items():
            encs = [payloads[i][0] for i in idx]
            cands = [payloads[i][1] for i in idx]
            m = max(c.shape[1] for c in cands)
            padded = [torch.cat([c, c[:, :1].expand(-1, m - c.shape[1], -1)], dim=1) if c.shape[1] < m else c for c in cands]
            sc = score_sids(self.local.model, EncoderState.cat(encs), torch.cat(padded), full=full)
            start = 0
            for i, c in zip(idx, cands):
                r, mm = c.shape[0], c.shape[1]
                tl = sc.token_logp[start : start + r, :mm]
                fl = [f[start : start + r, :mm] for f in sc.full] if full else None
                out[i] = (tl, fl)
                start += r
        return out

    @torch.inference_mode()
    def _beam_batch(self, payloads):
        groups: dict[tuple, list[int]] = {}
        for i, (h, width, snap) in enumerate(payloads):
            groups.setdefault((width, snap.version), []).append(i)
        out: list = [None] * len(payloads)
        for (width, _), idx in groups.items():
            hists = [payloads[i][0] for i in idx]
            snap = payloads[idx[0]][2]
            enc = self.local.model.encode(torch.from_numpy(np.concatenate(hists)))
            beams = beam_search(self.local.model, enc, snap.itemset.trie, width)
            start = 0
            for i, h in zip(idx, hists):
                out[i] = beams.select(torch.arange(start, start + len(h)))
                start += len(h)
        return out

    # -- sessions ------------------------------------------------------------------------------------
    def new_session(self, enc: EncoderState, snap: Snapshot) -> str:
        sid = uuid.uuid4().hex
        self.sessions[sid] = Entry(Session(enc.n, LocalState(enc)), snap, time.monotonic())
        while len(self.sessions) > self.s.max_sessions:
            self.sessions.popitem(last=False)
        return sid

    def entry(self, sid: str) -> Entry:
        e = self.sessions.get(sid)
        if e is None:
            raise FailedPrecondition(f"session: unknown or expired session {sid!r} (Encode again)")
        e.touched = time.monotonic()
        self.sessions.move_to_end(sid)
        return e

    async def compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def beams_msg(b: Beams) -> verifier_pb2.Beams:
    return verifier_pb2.Beams(codes=to_msg(b.codes), scores=to_msg(b.scores.float()), token_logp=to_msg(b.token_logp.float()),
                              alive=to_msg(b.alive()))


class Servicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, svc: VerifierService):
        self.svc = svc

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

    def _sids(self, m, field: str, rows: int, full_len: bool = True) -> torch.Tensor:
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

    async def _snap(self, version: str) -> Snapshot:
        return await self.svc.catalogue.get(version)

    @handle_errors
    async def Encode(self, request, context):
        h = self._hist(request.history_sids, "history_sids")
        snap = await self._snap(request.version)
        try:
            enc = await self.svc.batchers["encode"].submit((h,), _deadline(context))
        except Expired as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        sid = self.svc.new_session(enc, snap)
        self.svc.sessions[sid].session.calls["encode"] += 1
        return verifier_pb2.EncodeResponse(session=sid, version=snap.version, n=enc.n)

    @handle_errors
    async def Score(self, request, context):
        e = self.svc.entry(request.session)
        sids = self._sids(request.sids, "sids", e.session.n)
        try:
            tl, full = await self.svc.batchers["score"].submit((e.session.state.enc, sids, request.full), _deadline(context))
        except Expired as ex:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(ex))
        e.session.calls["score"] += 1
        return verifier_pb2.ScoreResponse(token_logp=to_msg(tl), full=[to_msg(f) for f in full or []])

    @handle_errors
    async def Expand(self, request, context):
        e = self.svc.entry(request.session)
        pre = self._sids(request.prefixes, "prefixes", e.session.n, full_len=False)
        logp = await self.svc.compute(self.svc.local.next_logprobs, e.session, pre)
        return verifier_pb2.ExpandResponse(logp=to_msg(logp))

    @handle_errors
    async def BeamStep(self, request, context):
        e = self.svc.entry(request.session)
        st = e.session.state
        if request.keep_rows:
            keep = list(request.keep_rows)
            require(all(0 <= r < e.session.n for r in keep) and len(set(keep)) == len(keep), "keep_rows",
                    f"rows must be distinct and within 0..{e.session.n - 1}")
            e.session = await self.svc.compute(self.svc.local.select, e.session, torch.tensor(keep))
            st = e.session.state
        if st.beam is None:
            require(1 <= request.width <= self.svc.s.max_width, "width", f"must be 1..{self.svc.s.max_width}")
            self.svc.local.beam_start(e.session, e.snap.itemset.trie, request.width)
        elif st.beam.done:
            raise FailedPrecondition("session: its beam search is already complete")
        beams = await self.svc.compute(self.svc.local.beam_step, e.session)
        return beams_msg(beams)

    @handle_errors
    async def BeamSearch(self, request, context):
        h = self._hist(request.history_sids, "history_sids")
        require(1 <= request.width <= self.svc.s.max_width, "width", f"must be 1..{self.svc.s.max_width}")
        snap = await self._snap(request.version)
        try:
            beams = await self.svc.batchers["beam_search"].submit((h, request.width, snap), _deadline(context))
        except Expired as ex:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(ex))
        return beams_msg(beams)

    @handle_errors
    async def HeadDrafts(self, request, context):
        if self.svc.local.head is None:
            raise FailedPrecondition("this verifier's bundle has no NEZHA draft head")
        e = self.svc.entry(request.session)
        require(1 <= request.width <= self.svc.s.max_width, "width", f"must be 1..{self.svc.s.max_width}")
        beams = await self.svc.compute(self.svc.local.head_beams, e.session, e.snap.itemset.trie, request.width)
        return beams_msg(beams)

    @handle_errors
    async def HeadLogprobs(self, request, context):
        if self.svc.local.head is None:
            raise FailedPrecondition("this verifier's bundle has no NEZHA draft head")
        e = self.svc.entry(request.session)
        pre = self._sids(request.prefixes, "prefixes", e.session.n, full_len=False)
        out = await self.svc.compute(self.svc.local.head_logprobs, e.session, pre)
        return verifier_pb2.HeadLogprobsResponse(logp=[to_msg(x) for x in out])

    @handle_errors
    async def Release(self, request, context):
        self.svc.sessions.pop(request.session, None)
        return verifier_pb2.ReleaseResponse()
