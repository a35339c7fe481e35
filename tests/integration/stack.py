"""The four services on loopback, in this process, over a real Redis.

``Stack.start`` brings up item set -> verifier -> drafter -> gateway (each
with port 0, wired to the others' real ports) and waits until every one is
SERVING; services can be stopped and restarted individually.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from drafter_svc.service import DrafterService, DrafterSettings
from gateway.service import GatewayService, GatewaySettings
from itemset_svc.service import ItemSetService
from itemset_svc.settings import ItemSetSettings
from specrec_rpc.server import Runner
from specrec_rpc.v1 import (
    drafter_pb2_grpc,
    itemset_pb2_grpc,
    recommender_pb2,
    recommender_pb2_grpc,
    verifier_pb2_grpc,
)
from verifier_svc.service import VerifierService, VerifierSettings

TOKEN = "stack-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def build_serving_bundle(src: Path, dst: Path, sid_drafters: bool = True) -> Path:
    """The tiny bundle plus (untrained) drafters: retrieval model with real
    text embeddings, self-draft head, NEZHA head, distilled SID-MLP drafter. Without ``sid_drafters`` only
    the item drafters (retrieval, text): a bundle like ``bundles/beauty-temporal``, one a user trains without
    ``train-drafters --which distill``."""
    import torch

    from specrec.bundle import Bundle, round_to_half
    from specrec.ids.embed import TextEmbedder
    from specrec.models.nezha_head import NezhaHead
    from specrec.models.retrieval import RetrievalConfig, RetrievalModel
    from specrec.models.self_draft import SelfDraftHead
    from specrec.models.sid_mlp import SidMlpConfig, SidMlpDrafter

    b = Bundle.load(src)
    torch.manual_seed(1)
    b.text_emb = TextEmbedder(progress=False)(b.catalogue.texts)
    b.retrieval = round_to_half(RetrievalModel(RetrievalConfig(max_history=b.cfg.max_history)).eval())
    if sid_drafters:
        b.self_draft = round_to_half(SelfDraftHead(b.model).eval())
        b.nezha_head = round_to_half(NezhaHead(b.model).eval())
        b.sid_mlp = round_to_half(SidMlpDrafter(b.cfg.level_sizes, b.cfg.d_model,
                                                SidMlpConfig(hidden=32, ff=64)).eval())
    b.meta.setdefault("drafters", {})["text_share"] = 0.3  # text neighbours reach new items
    return b.save(dst)


@dataclass
class Stack:
    redis_url: str
    namespace: str
    bundle: Path
    runners: dict[str, Runner] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    gateway_overrides: dict = field(default_factory=dict)
    common_overrides: dict = field(default_factory=dict)  # every service's settings (e.g. TLS)
    itemset_overrides: dict = field(default_factory=dict)
    verifier_overrides: dict = field(default_factory=dict)
    drafter_overrides: dict = field(default_factory=dict)
    credentials: grpc.ChannelCredentials | None = None  # the test's own channels (None: plaintext)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _settings(self, name: str):
        common = dict(host="127.0.0.1", port=self.ports.get(name, 0), metrics_port=0, log_json=False, grace_s=1.0,
                      **self.common_overrides)
        if name == "itemset":
            return ItemSetSettings(**{**common, **dict(redis_url=self.redis_url, namespace=self.namespace,
                                                       write_token=TOKEN, bundle=self.bundle, startup_wait_s=5.0),
                                      **self.itemset_overrides})
        if name == "verifier":
            return VerifierSettings(**{**common, **dict(bundle=self.bundle, itemset_addr=self.addr("itemset"),
                                                        threads=1, warmup_k=[10]), **self.verifier_overrides})
        if name == "drafter":
            return DrafterSettings(**{**common, **dict(bundle=self.bundle, itemset_addr=self.addr("itemset")),
                                      **self.drafter_overrides})
        gw = dict(
            itemset_addr=self.addr("itemset"),
            drafter_addr=self.addr("drafter"),
            verifier_addr=self.addr("verifier"),
            max_history=8,
            workers=8,
        )
        return GatewaySettings(**{**common, **gw, **self.gateway_overrides})

    async def start_one(self, name: str, replica: str = "", **overrides) -> None:
        """Start a service; ``replica`` (e.g. "2") starts another replica of it, keyed ``name + replica``;
        ``overrides``: settings of this one alone."""
        key = name + replica
        cls = {
            "itemset": ItemSetService,
            "verifier": VerifierService,
            "drafter": DrafterService,
            "gateway": GatewayService,
        }[name]
        settings = self._settings(name)
        if replica or overrides:
            settings = type(settings)(**{**settings.model_dump(), "port": self.ports.get(key, 0), **overrides})
        runner = Runner(cls(settings))
        self.ports[key] = await runner.start()
        self.runners[key] = runner

    async def stop_one(self, name: str) -> None:
        runner = self.runners.pop(name, None)
        if runner is not None:
            await runner.stop(0.5)

    async def start(self) -> Stack:
        for name in ("itemset", "verifier", "drafter", "gateway"):
            await self.start_one(name)
        self.channels = {}
        return self

    def channel(self, name: str) -> grpc.aio.Channel:
        if name not in self.channels:
            self.channels[name] = (grpc.aio.secure_channel(self.addr(name), self.credentials) if self.credentials
                                   else grpc.aio.insecure_channel(self.addr(name)))
        return self.channels[name]

    @property
    def gateway(self):
        return recommender_pb2_grpc.RecommenderStub(self.channel("gateway"))

    @property
    def itemset(self):
        return itemset_pb2_grpc.ItemSetStub(self.channel("itemset"))

    @property
    def verifier(self):
        return verifier_pb2_grpc.VerifierStub(self.channel("verifier"))

    @property
    def drafter(self):
        return drafter_pb2_grpc.DrafterStub(self.channel("drafter"))

    async def stop(self) -> None:
        for ch in getattr(self, "channels", {}).values():
            await ch.close()
        for name in ("gateway", *[k for k in self.runners if k not in ("gateway", "itemset")], "itemset"):
            await self.stop_one(name)

    async def recommend(self, history, k=10, policy="", budget_ms=1000.0, params=None, timeout=30.0,
                        exclude_history=False):
        req = recommender_pb2.RecommendRequest(
            history=[str(h) for h in history],
            k=k,
            policy=policy,
            budget_ms=budget_ms,
            params={a: str(b) for a, b in (params or {}).items()},
            exclude_history=exclude_history,
        )
        return await self.gateway.Recommend(req, timeout=timeout)


@contextlib.asynccontextmanager
async def running(redis_url: str, prefix: str, bundle: Path, **overrides):
    """A stack on ``bundle`` in a Redis namespace of its own (``prefix-<ns>``), stopped and its keys deleted
    at the end; ``overrides``: :class:`Stack`'s (``gateway_overrides``, ``verifier_overrides``, ...)."""
    from specrec_stack.localstack import delete_keys, namespace_pattern

    ns = f"{prefix}-{time.time_ns()}"
    st = await Stack(redis_url, ns, bundle, **overrides).start()
    try:
        yield st
    finally:
        await st.stop()
        delete_keys(redis_url, namespace_pattern(ns))


def histories(bundle, n: int, seed: int = 0) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    ids = bundle.catalogue.ids
    return [[ids[i] for i in rng.choice(len(ids), size=int(rng.integers(1, 10)), replace=False)] for _ in range(n)]
