"""A bare gRPC front: the floor the gateway's request path is measured against (``bench.request_path``).

    python -m bench.bare_front --port 0 --drafter 127.0.0.1:50052 --verifier 127.0.0.1:50053 \\
        --ids ids.json --candidates 40 --max-history 20

A plain ``grpc.aio`` server of the ``Recommender`` service, with nothing of SpecRec's serving code: per
``Recommend`` it looks the history's ids up in a dict, makes the two calls a fused request makes (``Draft`` with
the history's rows; ``Search`` of ``rank`` with the history's and the drafted rows, on the verifier's current
catalogue version), and answers the drafted items in the order of their summed token log-probabilities, with a
``served_by``. It serves the standard health service too: its ``Check`` is the bare round trip. No validation
beyond the lookup, no budget, no fallback, no metrics: what any Python gRPC front making the same two calls
costs, on the same machine, beside the same services. ``--ids``: a JSON list of the catalogue's ids by row. With
``--port 0`` it prints the port it bound (``port N``) on its first line.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2_grpc

from specrec_rpc.tensors import from_msg, to_msg
from specrec_rpc.v1 import (
    drafter_pb2,
    drafter_pb2_grpc,
    recommender_pb2,
    recommender_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)


class BareFront(recommender_pb2_grpc.RecommenderServicer):
    def __init__(self, ids: list[str], drafter: str, verifier: str, candidates: int, window: int):
        self.ids, self.index = ids, {i: r for r, i in enumerate(ids)}
        self.drafter = drafter_pb2_grpc.DrafterStub(grpc.aio.insecure_channel(drafter))
        self.verifier = verifier_pb2_grpc.VerifierStub(grpc.aio.insecure_channel(verifier))
        self.candidates, self.window = candidates, window

    async def Recommend(self, request, context):
        rows = np.asarray([self.index[i] for i in request.history if i in self.index][-self.window:], np.int32)
        d = await self.drafter.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(
            history_rows=to_msg(rows), n=self.candidates)]))
        cand = from_msg(d.drafts[0].rows)
        r = await self.verifier.Search(verifier_pb2.SearchRequest(
            ref=verifier_pb2.SessionRef(history_rows=to_msg(rows[None])), search="rank",
            row_tensors={"sids": to_msg(cand[None])}))
        score = from_msg(r.tensors["token_logp"])[0].sum(-1)
        best = np.argsort(-score, kind="stable")[: request.k]
        return recommender_pb2.RecommendResponse(
            items=[recommender_pb2.RecommendedItem(item_id=self.ids[cand[j]], score=float(score[j])) for j in best],
            stats=recommender_pb2.RecommendStats(served_by="bare"))


async def serve(a) -> None:
    server = grpc.aio.server()
    front = BareFront(json.loads(open(a.ids).read()), a.drafter, a.verifier, a.candidates, a.max_history)
    recommender_pb2_grpc.add_RecommenderServicer_to_server(front, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # the bare round trip: its Check
    port = server.add_insecure_port(f"127.0.0.1:{a.port}")
    await server.start()
    print(f"port {port}", flush=True)
    await server.wait_for_termination()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--ids", required=True, help="JSON list of the catalogue's item ids by row")
    ap.add_argument("--candidates", type=int, default=40)
    ap.add_argument("--max-history", type=int, default=20)
    asyncio.run(serve(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
