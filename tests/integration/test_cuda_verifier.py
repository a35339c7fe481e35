"""The verifier service on the CUDA backend (here its CPU stand-in: the same buckets, static buffers and chunks,
the graphs' functions run eagerly): concurrent callers' jobs batched into the captured row buckets answer what
the eager backend answers in process, every graph the warm-up's K need is made before SERVING (none by a call
afterwards), and the gateway serves through it, the same lists as in process."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from specrec.bundle import Bundle
from specrec.decoding.beam import beam_search
from specrec_rpc.tensors import to_msg, to_torch
from specrec_rpc.v1 import verifier_pb2

from .stack import Stack, build_serving_bundle

SIZES = [1, 2, 4]


@pytest.fixture(scope="module")
def cbundle_dir(tiny_bundle_dir, tmp_path_factory):
    return build_serving_bundle(tiny_bundle_dir, tmp_path_factory.mktemp("cb") / "bundle")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cstack(redis_url, cbundle_dir):
    from specrec_stack.localstack import delete_keys, namespace_pattern

    ns = f"cuda-{time.time_ns()}"
    st = Stack(redis_url, ns, cbundle_dir, verifier_overrides=dict(backend="cuda", device="cpu",
                                                                   cuda_graph_batch_sizes=SIZES, warmup_k=[5, 10]))
    await st.start()
    yield st
    await st.stop()
    delete_keys(redis_url, namespace_pattern(ns))


def _service(st: Stack):
    return st.runners["verifier"].service


@pytest.mark.asyncio(loop_scope="session")
async def test_concurrent_callers_are_batched_into_buckets_and_answer_as_eager(cstack, cbundle_dir):
    b = Bundle.load(cbundle_dir)
    eager = b.backend("eager")
    rng = np.random.default_rng(4)
    hists = [rng.integers(0, len(b.sids), int(rng.integers(1, 8))) for _ in range(7)]
    h = [b.history_sids([x]) for x in hists]
    backend = _service(cstack).local.backend
    assert backend.describe()["backend"] == "cuda" and backend.runner.started
    made = len(backend.runner)
    batches = REGISTRY.get_sample_value("specrec_verifier_batch_size_count", {"batcher": "verifier"})

    async def beam(i):
        r = await cstack.verifier.Search(verifier_pb2.SearchRequest(
            ref=verifier_pb2.SessionRef(history_sids=to_msg(h[i])), search="beam", widths={"width": 5}))
        return r.tensors

    async def rank(i):
        cand = torch.from_numpy(b.sids[rng.permutation(len(b.sids))[:8]])[None]
        r = await cstack.verifier.Search(verifier_pb2.SearchRequest(
            ref=verifier_pb2.SessionRef(history_sids=to_msg(h[i])), search="rank", tensors={"sids": to_msg(cand)}))
        return cand, r.tensors

    got = await asyncio.gather(*(beam(i) for i in range(len(h))))
    ranked = await asyncio.gather(*(rank(i) for i in range(len(h))))
    with torch.inference_mode():
        for i, g in enumerate(got):
            want = beam_search(eager, eager.encode(h[i]), b.trie, 5)
            assert torch.equal(to_torch(g["codes"]), want.codes)
            assert torch.allclose(to_torch(g["scores"]), want.scores, atol=1e-4)
        for i, (cand, r) in enumerate(ranked):
            want = eager.search("rank", eager.encode(h[i]), None, (), {"sids": cand})
            assert torch.allclose(to_torch(r["token_logp"]), want, atol=1e-4)
    after = REGISTRY.get_sample_value("specrec_verifier_batch_size_count", {"batcher": "verifier"})
    assert after - batches < 2 * len(h)  # some callers' jobs shared a batch (a bucket of their rows)
    assert len(backend.runner) == made and backend.runner.captured_after_start == 0  # all made before SERVING
    assert REGISTRY.get_sample_value("specrec_verifier_graphs", {"when": "warm_up"}) >= len(SIZES) * 5


@pytest.mark.asyncio(loop_scope="session")
async def test_the_gateway_serves_through_it_the_lists_in_process(cstack, cbundle_dir):
    from specrec import Recommender

    rec = Recommender.load(cbundle_dir, backend="eager", warmup=False)
    rng = np.random.default_rng(9)
    ids = rec.bundle.catalogue.ids
    for _ in range(4):
        hist = [ids[r] for r in rng.integers(0, len(ids), 4)]
        for policy in ("beam", "strict", "nezha"):
            resp = await cstack.recommend(hist, k=5, policy=policy, budget_ms=1000.0)
            want = rec.recommend(hist, k=5, policy=policy, budget_ms=1000.0)
            assert [it.item_id for it in resp.items] == [it.id for it in want.items], policy
            assert resp.stats.served_by == policy


def test_the_settings_build_a_cuda_backend(cbundle_dir):
    from verifier_svc.settings import VerifierSettings, backend_options

    s = VerifierSettings(backend="cuda", device="cpu", cuda_graph_batch_sizes=[1, 8])
    be = Bundle.load(cbundle_dir).backend(s.backend, **backend_options(s))
    assert be.sizes == (1, 8) and be.describe()["device"] == "cpu" and not be.runner.capture
    with pytest.raises(ValueError):
        VerifierSettings(backend="cuda", cuda_graph_batch_sizes=[0])
