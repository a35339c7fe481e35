"""A small Python client for the gateway, and the printing used by
``specrec recommend`` and the local stack.

    from specrec_rpc.client import Client
    with Client("127.0.0.1:50050") as c:
        resp = c.recommend(["1", "2", "3"], k=10, policy="specgr", budget_ms=30)
        for it in resp.items:
            print(it.item_id, it.score, it.title)
"""

from __future__ import annotations

import time

import grpc

from .v1 import recommender_pb2, recommender_pb2_grpc


class Client:
    def __init__(self, target: str = "127.0.0.1:50050", timeout_s: float = 5.0):
        self.channel = grpc.insecure_channel(target)
        self.stub = recommender_pb2_grpc.RecommenderStub(self.channel)
        self.timeout_s = timeout_s

    def recommend(self, history: list[str], k: int = 10, policy: str = "", budget_ms: float = 0.0,
                  params: dict | None = None, user_id: str = "") -> recommender_pb2.RecommendResponse:
        req = recommender_pb2.RecommendRequest(
            history=[str(h) for h in history],
            k=k,
            policy=policy,
            budget_ms=budget_ms,
            params={k_: str(v) for k_, v in (params or {}).items()},
            user_id=user_id,
        )
        return self.stub.Recommend(req, timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def format_response(
    resp: recommender_pb2.RecommendResponse, latency_ms: float | None = None, history_titles=None
) -> str:
    st = resp.stats
    lines = []
    if history_titles:
        lines.append("history: " + " | ".join(t[:40] for t in history_titles[-5:]))
    head = (
        f"policy {st.policy}  exit {st.exit_reason}  rounds {st.rounds}  drafted {st.drafted}  accepted {st.accepted}  "
        f"verifier calls {st.verifier_calls}  catalogue v{st.catalogue_version}  server {st.total_ms:.1f} ms"
    )
    if latency_ms is not None:
        head += f"  client {latency_ms:.1f} ms"
    lines.append(head)
    if st.degraded:
        lines.append(f"DEGRADED: {st.degraded_reason}")
    if st.ignored_history:
        lines.append(f"ignored history ids (not in catalogue v{st.catalogue_version}): {', '.join(st.ignored_history)}")
    for i, it in enumerate(resp.items, 1):
        flag = " [new]" if it.unseen else ""
        lines.append(f"{i:>3}. {it.score:8.3f}  {it.source:<6} {it.item_id:>8}  {it.title[:70]}{flag}")
    stages = ", ".join(f"{k} {v:.1f}" for k, v in sorted(st.stage_ms.items()))
    lines.append(f"stages (ms): {stages}")
    return "\n".join(lines)


def timed_recommend(client: Client, *args, **kwargs):
    t0 = time.perf_counter()
    resp = client.recommend(*args, **kwargs)
    return resp, (time.perf_counter() - t0) * 1000.0
