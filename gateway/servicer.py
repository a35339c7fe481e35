"""The Recommender servicer: validate -> admit -> serve -> respond.

- validate (:func:`.request.validate`): every field checked, the catalogue
  version pinned, the history resolved, the one deadline fixed;
- admit (:meth:`.service.GatewayService.admit`, on the event loop, seeing
  every request admitted before it): the policy to run (``auto`` chooses
  now), counted at the service it uses; RESOURCE_EXHAUSTED when nothing fits;
- serve (:meth:`.service.GatewayService.run_policy`, in a worker thread, in a
  copy of this context so the trace span and log bindings follow): the policy
  or its fallback ladder answers;
- respond: the items and the stats, and the request's log line when it was
  degraded, shed or failed (:mod:`.requestlog`); its metrics once the answer has
  left (:meth:`.service.GatewayService.record`, on the loop's next turn).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any, Protocol

import grpc

from specrec.policies import Overloaded, RecResult
from specrec.policies.errors import Unsupported
from specrec_rpc import tracing
from specrec_rpc.catalogue import CatalogueWatcher
from specrec_rpc.errors import InvalidArgument, ResourceExhausted, handle_errors, require
from specrec_rpc.server import Admission
from specrec_rpc.v1 import common_pb2, recommender_pb2, recommender_pb2_grpc

from .budget import caller_deadline
from .request import Admitted, ValidRequest, validate
from .requestlog import RequestLog
from .settings import GatewaySettings


class Gateway(Protocol):
    """What the servicer needs of the gateway (:class:`gateway.service.GatewayService`, which builds it): the
    servicer is its adapter to the wire and does not import it."""

    s: GatewaySettings
    log: Any  # a structlog logger
    requests_log: RequestLog
    catalogue: CatalogueWatcher
    admission: Admission

    def admit(self, valid: ValidRequest) -> Admitted: ...

    async def serve(self, run: Admitted, ctx: contextvars.Context | None = None) -> RecResult: ...

    def record(self, run: Admitted, res: RecResult, total_ms: float) -> None: ...


def respond(valid: ValidRequest, res: RecResult, t0: float) -> recommender_pb2.RecommendResponse:
    """The answer on the wire: items (id, SID, score, title, unseen, source) and the stats."""
    snap, it = valid.snap, valid.snap.itemset
    items = [recommender_pb2.RecommendedItem(
        item_id=snap.ids[r], sid=common_pb2.Sid(codes=it.sids[r].tolist()),
        score=float(sc), title=snap.titles[r], unseen=not bool(it.seen[r]), source=src)
        for r, sc, src in zip(res.items.tolist(), res.scores.tolist(), res.sources)]
    st, degraded, policy = res.stats, res.degraded, valid.policy
    stats = recommender_pb2.RecommendStats(
        policy=policy, served_by=res.served_by, rounds=st.rounds, drafted=st.draft_items, accepted=st.accepted_items,
        draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens, verifier_calls=st.verifier_calls,
        encoder_calls=st.encoder_calls, exit_reason=st.exit_reason,
        stage_ms={k: float(v) for k, v in st.stage_ms.items()}, catalogue_version=snap.version,
        degraded=bool(degraded), degraded_reason=degraded, total_ms=(time.monotonic() - t0) * 1000.0,
        request_id=valid.rid)
    stats.ignored_history.extend(valid.ignored)
    return recommender_pb2.RecommendResponse(items=items, stats=stats)


class Servicer(recommender_pb2_grpc.RecommenderServicer):
    def __init__(self, svc: Gateway):
        self.svc = svc

    def caller_deadline(self, context: grpc.aio.ServicerContext) -> float | None:
        """The caller's gRPC deadline (time.monotonic()), less the reply margin; None when it set none."""
        return caller_deadline(self.svc.s, context.time_remaining())

    async def _recommend(self, r, prefix: str = "", rid: str = "",
                         caller_deadline: float | None = None) -> recommender_pb2.RecommendResponse:
        """One request, and its log line when it was degraded, shed or failed (requestlog.py)."""
        t0 = time.monotonic()
        method = "RecommendBatch" if prefix else "Recommend"
        try:
            resp = await self._serve(r, t0, prefix, rid, caller_deadline)
        except BaseException as e:
            self.svc.requests_log.refused(r, rid, e, t0, method)
            raise
        self.svc.requests_log.answered(r, resp, rid, method)
        return resp

    async def _serve(self, r, t0: float, prefix: str, rid: str,
                     caller_deadline: float | None) -> recommender_pb2.RecommendResponse:
        snap = self.svc.catalogue.current
        assert snap is not None  # the service serves only once the catalogue watcher has a version
        valid = validate(r, self.svc.s, snap, t0, caller_deadline, prefix, rid)
        try:
            run = self.svc.admit(valid)
        except Overloaded as e:
            raise ResourceExhausted(f"overloaded: {e}") from None
        res = await self.svc.serve(run, contextvars.copy_context())
        resp = respond(valid, res, t0)
        # its metrics on the loop's next turn, once the answer has left
        asyncio.get_running_loop().call_soon(self.svc.record, run, res, resp.stats.total_ms)
        return resp

    @handle_errors
    async def Recommend(self, request: recommender_pb2.RecommendRequest,
                        context: grpc.aio.ServicerContext) -> recommender_pb2.RecommendResponse:
        return await self._recommend(request, rid=tracing.request_id_of(context),
                                     caller_deadline=self.caller_deadline(context))

    async def _batch_item(self, i: int, r, rid: str, caller_deadline: float | None) -> recommender_pb2.RecommendResult:
        try:
            return recommender_pb2.RecommendResult(response=await self._recommend(r, f"requests[{i}].", f"{rid}-{i}",
                                                                                  caller_deadline))
        except InvalidArgument as e:
            return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                   error_message=str(e))
        except ResourceExhausted as e:
            return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                                   error_message=str(e))
        except Unsupported as e:  # the policy named cannot run on the verifiers' bundles
            return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                                   error_message=str(e))
        except Exception:
            self.svc.log.exception("batch item failed", index=i)
            return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.INTERNAL.value[0],
                                                   error_message="internal error (see the gateway's log)")

    @handle_errors
    async def RecommendBatch(self, request: recommender_pb2.RecommendBatchRequest,
                             context: grpc.aio.ServicerContext) -> recommender_pb2.RecommendBatchResponse:
        rid, caller_deadline = tracing.request_id_of(context), self.caller_deadline(context)
        require(1 <= len(request.requests) <= self.svc.s.max_batch, "requests", f"1..{self.svc.s.max_batch} requests")
        extra = len(request.requests) - 1  # the RPC holds one slot; every further item counts too
        if not self.svc.admission.try_take(extra):
            e = ResourceExhausted(f"overloaded: {self.svc.admission.inflight} requests in flight, "
                                  f"{len(request.requests)} more asked")
            self.svc.log.warning("request", outcome="shed", request_id=rid, method="RecommendBatch",
                                 code="RESOURCE_EXHAUSTED", reason=str(e), requests=len(request.requests))
            raise e
        try:
            results = await asyncio.gather(*(self._batch_item(i, r, rid, caller_deadline)
                                             for i, r in enumerate(request.requests)))
        finally:
            self.svc.admission.release(extra)
        return recommender_pb2.RecommendBatchResponse(results=results)
