"""The verifier service on loopback: equal to the in-process verifier,
dynamic batching, deadline-aware dropping, the ONNX Runtime backend, and
field-naming errors."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from specrec.bundle import Bundle
from specrec.decoding.beam import beam_search
from specrec.decoding.scoring import score_sids
from specrec_rpc.server import Runner
from specrec_rpc.tensors import to_msg, to_torch
from specrec_rpc.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.service import VerifierService, VerifierSettings

from .stack import Stack, build_serving_bundle


@pytest.fixture(scope="module")
def vbundle_dir(tiny_bundle_dir, tmp_path_factory):
    return build_serving_bundle(tiny_bundle_dir, tmp_path_factory.mktemp("vb") / "bundle")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vstack(redis_url, vbundle_dir):
    from specrec_stack.localstack import delete_keys, namespace_pattern

    ns = f"ver-{time.time_ns()}"
    st = Stack(redis_url, ns, vbundle_dir)
    await st.start_one("itemset")
    await st.start_one("verifier")
    st.channels = {}
    yield st
    await st.stop()
    delete_keys(redis_url, namespace_pattern(ns))


def hist_tensor(bundle, rows_list):
    return bundle.history_sids([np.asarray(r) for r in rows_list])


def metric(name, **labels) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def search(stub, name: str, r, tensors=None, rule=None, **widths):
    """One Search call (the registry's ``name``, its widths by name, its tensors by name)."""
    return stub.Search(verifier_pb2.SearchRequest(ref=r, search=name, widths=widths, tensors=tensors or {},
                                                  rule=rule))


def out(reply, name: str) -> torch.Tensor:
    return to_torch(reply.tensors[name])


def ref(session="", hist=None, keep=False):
    if session:
        return verifier_pb2.SessionRef(session=session)
    return verifier_pb2.SessionRef(history_sids=to_msg(hist), keep=keep)


@pytest.mark.asyncio(loop_scope="session")
async def test_score_and_beam_equal_local(vstack, vbundle_dir):
    b = Bundle.load(vbundle_dir)
    be = b.backend("eager")
    stub = vstack.verifier
    h = hist_tensor(b, [[0, 5, 9], [3], [7, 8, 1, 2, 11]])
    enc = await stub.Encode(verifier_pb2.EncodeRequest(history_sids=to_msg(h)))
    cand = torch.from_numpy(b.sids[np.arange(30)]).view(3, 10, 4)
    r = await stub.Score(verifier_pb2.ScoreRequest(ref=ref(enc.session), sids=to_msg(cand), full=True))
    with torch.inference_mode():
        e = be.encode(h)
        want = score_sids(be, e, cand, full=True)
        beams = beam_search(be, e, b.trie, 7)
    assert torch.allclose(to_torch(r.token_logp), want.token_logp, atol=1e-4)
    assert all(torch.allclose(to_torch(x), y, atol=1e-4) for x, y in zip(r.full, want.full))
    # one call from the history: no session kept
    got = await search(stub, "beam", ref(hist=h), width=7)
    assert torch.equal(out(got, "codes"), beams.codes) and got.session == ""
    # the session's own stepwise beam search ends in the same beams
    for _ in range(4):
        step = await stub.BeamStep(verifier_pb2.BeamStepRequest(ref=ref(enc.session), width=7))
    assert torch.equal(to_torch(step.codes), beams.codes)
    await stub.Release(verifier_pb2.ReleaseRequest(session=enc.session))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_call_that_ends_its_session_needs_no_release(vstack, vbundle_dir):
    """The fused policy's last call (the scoring pass, Search "rank") says ``end``: it answers as a kept session's
    call would, then the session is forgotten, so no Release round trip is needed; a call without ``end`` keeps
    it."""
    b = Bundle.load(vbundle_dir)
    stub = vstack.verifier
    h = hist_tensor(b, [[0, 5, 9]])
    cand = torch.from_numpy(b.sids[np.arange(12)]).view(1, 12, 4)
    enc = await stub.Encode(verifier_pb2.EncodeRequest(history_sids=to_msg(h)))
    kept = await search(stub, "rank", ref(enc.session), {"sids": to_msg(cand)})
    assert kept.session == enc.session
    last = await search(stub, "rank", verifier_pb2.SessionRef(session=enc.session, end=True), {"sids": to_msg(cand)})
    assert last.session == "" and torch.equal(out(last, "token_logp"), out(kept, "token_logp"))
    with pytest.raises(grpc.aio.AioRpcError) as e:  # gone: the caller would re-send its history
        await search(stub, "rank", ref(enc.session), {"sids": to_msg(cand)})
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.asyncio(loop_scope="session")
async def test_history_travels_with_the_first_call_and_frontier_saves_a_pass(vstack, vbundle_dir):
    """strict over gRPC: head drafts (creating the session), a Score of the drafts, then the
    beam search reads what the Score verified: equal to plain beam search."""
    b = Bundle.load(vbundle_dir)
    stub = vstack.verifier
    h = hist_tensor(b, [[4, 2, 8, 9]])
    heads = await search(stub, "head", ref(hist=h, keep=True), width=30)
    assert heads.session
    codes = out(heads, "codes")[:, out(heads, "alive")[0]]
    await stub.Score(verifier_pb2.ScoreRequest(ref=ref(heads.session), sids=to_msg(codes)))
    got = await search(stub, "beam", ref(heads.session), width=5)
    want = await search(stub, "beam", ref(hist=h), width=5)
    assert torch.equal(out(got, "codes"), out(want, "codes"))
    assert torch.allclose(out(got, "scores"), out(want, "scores"), atol=1e-4)
    covered = to_torch(got.covered)
    assert covered.shape[0] == 4 and int(covered.sum()) > 0  # beams read from the verified drafts
    await stub.Release(verifier_pb2.ReleaseRequest(session=heads.session))


@pytest.mark.asyncio(loop_scope="session")
async def test_score_with_step_is_score_then_beam_step_in_one_call(vstack, vbundle_dir):
    """specgr's round over gRPC: the history travels with the first Score, which starts the search and takes
    its first step from its pass; every step reads the pass (computes nothing); the scores and beams are those of
    a Score with the frontier followed by a BeamStep."""
    b = Bundle.load(vbundle_dir)
    stub = vstack.verifier
    h = hist_tensor(b, [[4, 2, 8, 9]])
    L = len(b.cfg.level_sizes)
    rounds = [torch.from_numpy(b.sids[np.arange(6 * i, 6 * i + 6)])[None] for i in range(L)]  # [1, 6, L] each
    enc = await stub.Encode(verifier_pb2.EncodeRequest(history_sids=to_msg(h)))
    want = []
    for s in rounds:  # two calls a round, on a session of its own
        sc = await stub.Score(verifier_pb2.ScoreRequest(ref=ref(enc.session), sids=to_msg(s), with_frontier=True))
        want.append((sc, await stub.BeamStep(verifier_pb2.BeamStepRequest(ref=ref(enc.session), width=5))))
    session = ""
    for s, (sc, step) in zip(rounds, want):
        r = await stub.Score(verifier_pb2.ScoreRequest(ref=ref(session) if session else ref(hist=h, keep=True),
                                                       sids=to_msg(s), step=verifier_pb2.BeamOptions(width=5)))
        session = session or r.session
        assert session and torch.allclose(to_torch(r.token_logp), to_torch(sc.token_logp), atol=1e-5)
        assert torch.equal(to_torch(r.beams.codes), to_torch(step.codes))
        assert torch.allclose(to_torch(r.beams.scores), to_torch(step.scores), atol=1e-5)
        assert to_torch(r.beams.covered).shape == (1, 1) and int(to_torch(r.beams.computed).sum()) == 0
    with pytest.raises(grpc.aio.AioRpcError) as ei:  # the search is complete: nothing left to step
        await stub.Score(verifier_pb2.ScoreRequest(ref=ref(session), sids=to_msg(rounds[0]),
                                                   step=verifier_pb2.BeamOptions(width=5)))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Score(verifier_pb2.ScoreRequest(ref=ref(hist=h), sids=to_msg(rounds[0]),
                                                   step=verifier_pb2.BeamOptions(width=0)))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "step.width" in ei.value.details()
    for sid in (enc.session, session):
        await stub.Release(verifier_pb2.ReleaseRequest(session=sid))


@pytest.mark.asyncio(loop_scope="session")
async def test_draft_verify_over_grpc_equals_beam_search(vstack, vbundle_dir):
    """strict over gRPC in one call: where it says covered, its beams are beam's; concurrent calls share a batch
    and keep their own rows; the distilled drafter's search answers valid SIDs."""
    b = Bundle.load(vbundle_dir)
    stub = vstack.verifier
    sizes = b.cfg.level_sizes
    everything = len(b.catalogue)  # at least as many drafts per level as there are valid prefixes: always covered
    assert everything <= 1000
    hs = [hist_tensor(b, [[i, i + 3, i + 5]]) for i in range(6)]
    for n in (2, everything):
        outs = await asyncio.gather(*(search(stub, "strict", ref(hist=h), width=5, n=n) for h in hs))
        for h, d in zip(hs, outs):
            want = await search(stub, "beam", ref(hist=h), width=5)
            covered = bool(out(d, "covered")[0])
            assert out(d, "frontier").shape == (1, len(sizes) - 1, 2)
            if n == everything:
                assert covered
            if covered:
                assert torch.equal(out(d, "codes"), out(want, "codes"))
                assert torch.allclose(out(d, "scores"), out(want, "scores"), atol=1e-4)
    heads = await search(stub, "draft", ref(hist=hs[0]), width=7)
    codes = out(heads, "codes")[0][out(heads, "alive")[0]].numpy()
    assert len(codes) == 7 and b.itemset.contains(codes).all()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await search(stub, "strict", ref(hist=hs[0]), width=5, n=0)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "widths[n]" in ei.value.details()


@pytest.mark.asyncio(loop_scope="session")
async def test_one_search_rpc_answers_every_search_as_the_verifier_in_process(vstack, vbundle_dir):
    """Search answers each served search of the registry as the in-process verifier does (same name, widths and
    tensors); a name, width or tensor the search does not declare is INVALID_ARGUMENT naming it."""
    from specrec.decoding.searches import SEARCHES
    from specrec.verifier import LocalVerifier

    b = Bundle.load(vbundle_dir)
    local = LocalVerifier(b.backend(threads=1), b.nezha_head, b.model)
    stub = vstack.verifier
    h = hist_tensor(b, [[1, 4, 6], [2, 3]])
    sids = torch.from_numpy(b.sids[[[3, 7, 9], [0, 5, 8]]])
    calls = {"beam": {"width": 5}, "head": {"width": 6}, "draft": {"width": 6}, "draft_scored": {"width": 6},
             "strict": {"width": 5, "n": 4}, "rank": {}}
    assert set(calls) == {name for name, s in SEARCHES.items() if s.inside is None}  # every served search
    for name, widths in calls.items():
        s = SEARCHES[name]
        args = {a: sids for a in s.args}
        got = await search(stub, name, ref(hist=h), {a: to_msg(x) for a, x in args.items()}, **widths)
        with torch.inference_mode():
            want = s.reply(local.search(local.encode(h), name, b.trie, tuple(widths.values()), args))
        assert set(got.tensors) == set(want), name
        for k, x in want.items():
            assert torch.allclose(out(got, k).float(), x.float(), atol=1e-4), (name, k)
        assert not got.session  # nothing kept unless asked
    for bad, field in (({"search": "resume", "widths": {"width": 5}}, "search"),
                       ({"search": "beam", "widths": {"width": 5, "n": 2}}, "widths[n]"),
                       ({"search": "strict", "widths": {"width": 5}}, "widths[n]"),
                       ({"search": "rank"}, "tensors[sids]"),
                       ({"search": "head", "widths": {"width": 5}, "tensors": {"sids": to_msg(sids)}}, "tensors[sids]"),
                       ({"search": "head", "widths": {"width": 5}, "rule": verifier_pb2.SelectRule(kind="relaxed")},
                        "rule")):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Search(verifier_pb2.SearchRequest(ref=ref(hist=h), **bad))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details(), field


@pytest.mark.asyncio(loop_scope="session")
async def test_concurrent_requests_are_batched(vstack, vbundle_dir):
    """With compute threads (compute_on_loop off: a GPU's verifier, or more than one compute thread), calls that
    arrive while they compute are batched (on the loop's thread, what arrives together: tests/unit/test_batcher.py)."""
    b = Bundle.load(vbundle_dir)
    be = b.backend("eager")
    await vstack.start_one("verifier", replica="2", compute_on_loop=False)
    stub = verifier_pb2_grpc.VerifierStub(grpc.aio.insecure_channel(vstack.addr("verifier2")))
    hs = [hist_tensor(b, [[i, i + 1]]) for i in range(24)]
    # the compute threads are held busy while the 24 calls arrive (on a loaded machine they could otherwise
    # trickle in one by one, each computed alone), so they wait in the batcher's queue together
    svc = vstack.runners["verifier2"].service
    assert svc.batcher.executor is not None
    gate = threading.Event()
    arrived = 0
    submit = svc.batcher.submit

    async def counted(job, deadline):
        nonlocal arrived
        arrived += 1
        return await submit(job, deadline)

    held = [svc.executor.submit(gate.wait, 30.0) for _ in range(svc.s.compute_threads)]
    svc.batcher.submit = counted
    before_sum = metric("specrec_verifier_batch_size_sum", batcher="verifier")
    before_n = metric("specrec_verifier_batch_size_count", batcher="verifier")
    try:
        calls = asyncio.ensure_future(
            asyncio.gather(*(stub.Encode(verifier_pb2.EncodeRequest(history_sids=to_msg(h))) for h in hs))
        )
        t0 = time.monotonic()
        while arrived < 24 and time.monotonic() - t0 < 10.0:
            await asyncio.sleep(0.01)
    finally:
        gate.set()  # the later tests need the verifier's threads back, whatever happened here
        svc.batcher.submit = submit
    outs = await calls
    assert all(h.result() for h in held)
    assert len({o.session for o in outs}) == 24
    jobs = metric("specrec_verifier_batch_size_sum", batcher="verifier") - before_sum
    batches = metric("specrec_verifier_batch_size_count", batcher="verifier") - before_n
    assert jobs == 24 and batches < 24, (jobs, batches)  # several requests shared a forward pass
    # and batching does not change answers
    with torch.inference_mode():
        e = be.encode(torch.cat(hs))
    cand = torch.from_numpy(b.sids[:6])[None]
    scores = await asyncio.gather(*(stub.Score(verifier_pb2.ScoreRequest(ref=ref(o.session), sids=to_msg(cand)))
                                    for o in outs))
    with torch.inference_mode():
        want = score_sids(be, e, cand.expand(24, -1, -1)).token_logp
    for i, s in enumerate(scores):
        assert torch.allclose(to_torch(s.token_logp)[0], want[i], atol=1e-4)
    await vstack.stop_one("verifier2")


@pytest.mark.asyncio(loop_scope="session")
async def test_a_lone_call_does_not_wait_for_a_batch(vstack, vbundle_dir):
    """Opportunistic batching: an idle verifier computes a lone call at once (no batching window)."""
    b = Bundle.load(vbundle_dir)
    svc: VerifierService = vstack.runners["verifier"].service
    assert not svc.batcher.busy and not svc.batcher.queue
    before_wait = metric("specrec_verifier_queue_wait_seconds_sum", batcher="verifier")
    before_n = metric("specrec_verifier_queue_wait_seconds_count", batcher="verifier")
    before_jobs = metric("specrec_verifier_batch_size_sum", batcher="verifier")
    before_batches = metric("specrec_verifier_batch_size_count", batcher="verifier")
    h = to_msg(hist_tensor(b, [[1, 2]]))
    for _ in range(5):
        await vstack.verifier.Encode(verifier_pb2.EncodeRequest(history_sids=h))
    n = metric("specrec_verifier_queue_wait_seconds_count", batcher="verifier") - before_n
    wait = metric("specrec_verifier_queue_wait_seconds_sum", batcher="verifier") - before_wait
    jobs = metric("specrec_verifier_batch_size_sum", batcher="verifier") - before_jobs
    batches = metric("specrec_verifier_batch_size_count", batcher="verifier") - before_batches
    assert n == 5 and jobs == 5 and batches == 5  # each call computed alone, none held back for another
    # the wait is only the hand-off to the compute thread (a batching window would be >= its length);
    # 5 ms bounds it on 2 busy cores
    assert wait / n < 0.005, wait / n


@pytest.mark.asyncio(loop_scope="session")
async def test_expired_requests_are_dropped_not_computed(vstack, vbundle_dir):
    """(With a compute thread: one that computes on the loop's own thread drops them the same way,
    tests/unit/test_batcher.py.)"""
    b = Bundle.load(vbundle_dir)
    await vstack.start_one("verifier", replica="2", compute_on_loop=False)
    svc: VerifierService = vstack.runners["verifier2"].service
    stub = verifier_pb2_grpc.VerifierStub(grpc.aio.insecure_channel(vstack.addr("verifier2")))
    before = metric("specrec_verifier_expired_total", batcher="verifier")
    # occupy the compute thread, then send requests whose deadline passes while they queue
    busy = asyncio.get_running_loop().run_in_executor(svc.executor, time.sleep, 0.3)
    h = to_msg(hist_tensor(b, [[1, 2, 3]]))
    calls = [stub.Encode(verifier_pb2.EncodeRequest(history_sids=h), timeout=0.05) for _ in range(5)]
    res = await asyncio.gather(*calls, return_exceptions=True)
    await busy
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.DEADLINE_EXCEEDED for r in res)
    t0 = time.monotonic()
    while metric("specrec_verifier_expired_total", batcher="verifier") - before < 1:  # counted once dropped
        assert time.monotonic() - t0 < 5.0, "no queued job was dropped as expired"
        await asyncio.sleep(0.05)
    await vstack.stop_one("verifier2")


@pytest.mark.asyncio(loop_scope="session")
async def test_bad_requests_name_the_field(vstack):
    stub = vstack.verifier
    IA = grpc.StatusCode.INVALID_ARGUMENT
    bad = [
        (verifier_pb2.EncodeRequest(history_sids=to_msg(np.zeros((1, 3, 2), np.int64))), IA, "history_sids"),
        (
            verifier_pb2.EncodeRequest(history_sids=to_msg(np.full((1, 3, 4), 99, np.int64))),
            IA,
            "history_sids: code out of range",
        ),
        (verifier_pb2.EncodeRequest(history_sids=to_msg(np.full((1, 3, 4), -1, np.int64))), IA, "at least one item"),
        (verifier_pb2.EncodeRequest(history_sids=to_msg(np.zeros((1, 3, 4), np.float32))), IA, "dtype"),
        (
            verifier_pb2.EncodeRequest(history_sids=common_pb2.Tensor(shape=[1, 2, 4], dtype="int64", data=b"123")),
            IA,
            "bytes",
        ),
    ]
    for req, code, frag in bad:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Encode(req)
        assert ei.value.code() == code and frag in ei.value.details(), ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Score(verifier_pb2.ScoreRequest(ref=ref("nope"), sids=to_msg(np.zeros((1, 1, 4), np.int64))))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "session" in ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Score(verifier_pb2.ScoreRequest(sids=to_msg(np.zeros((1, 1, 4), np.int64))))
    assert ei.value.code() == IA and "ref" in ei.value.details()
    enc = await stub.Encode(verifier_pb2.EncodeRequest(history_sids=to_msg(np.zeros((2, 3, 4), np.int64))))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Score(verifier_pb2.ScoreRequest(ref=ref(enc.session), sids=to_msg(np.zeros((1, 1, 4), np.int64))))
    assert ei.value.code() == IA and "sids" in ei.value.details() and "rows" in ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.BeamStep(verifier_pb2.BeamStepRequest(ref=ref(enc.session), width=0))
    assert ei.value.code() == IA and "width" in ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await search(stub, "beam", ref(enc.session), rule=verifier_pb2.SelectRule(kind="fuzzy"), width=3)
    assert ei.value.code() == IA and "rule.kind" in ei.value.details()


@pytest.mark.asyncio(loop_scope="session")
async def test_rows_of_the_catalogue_stand_for_their_sids(vstack, vbundle_dir):
    """The gateway sends catalogue rows, not SIDs: a history as rows (``history_rows``, left-padded with -1) and a
    search's candidates as rows (``row_tensors``) answer exactly what their SIDs answer, the verifier reading
    them from its own copy of the catalogue; a row outside it, a negative candidate, an input given both ways or
    a history of padding alone is INVALID_ARGUMENT naming the field."""
    b = Bundle.load(vbundle_dir)
    stub = vstack.verifier
    IA = grpc.StatusCode.INVALID_ARGUMENT
    history, cand = [4, 2, 8, 9], np.arange(3, 15)
    rows = np.full((1, b.cfg.max_history), -1, np.int32)
    rows[0, -len(history):] = history
    by_rows = await stub.Search(verifier_pb2.SearchRequest(
        ref=verifier_pb2.SessionRef(history_rows=to_msg(rows)), search="rank",
        row_tensors={"sids": to_msg(cand.astype(np.int32)[None])}))
    by_sids = await search(stub, "rank", ref(hist=hist_tensor(b, [history])),
                           {"sids": to_msg(torch.from_numpy(b.sids[cand])[None])})
    assert torch.equal(out(by_rows, "token_logp"), out(by_sids, "token_logp"))
    enc = await stub.Encode(verifier_pb2.EncodeRequest(history_rows=to_msg(rows[:, -len(history):])))
    kept = await search(stub, "beam", ref(enc.session), width=5)
    assert torch.equal(out(kept, "codes"), out(await search(stub, "beam", ref(hist=hist_tensor(b, [history])),
                                                            width=5), "codes"))
    n = len(b.catalogue)
    bad = [(verifier_pb2.SessionRef(history_rows=to_msg(np.array([[1, n]], np.int32))), {}, "ref.history_rows"),
           (verifier_pb2.SessionRef(history_rows=to_msg(np.array([[-1, -1]], np.int32))), {}, "at least one item"),
           (verifier_pb2.SessionRef(history_rows=to_msg(np.array([[1, 2]], np.int64))), {}, "dtype"),
           (verifier_pb2.SessionRef(history_rows=to_msg(rows)), {"sids": to_msg(np.array([[0, -1]], np.int32))},
            "row_tensors[sids]")]
    for r, row_tensors, frag in bad:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Search(verifier_pb2.SearchRequest(ref=r, search="rank", row_tensors=row_tensors or {
                "sids": to_msg(cand.astype(np.int32)[None])}))
        assert ei.value.code() == IA and frag in ei.value.details(), ei.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Search(verifier_pb2.SearchRequest(
            ref=verifier_pb2.SessionRef(history_rows=to_msg(rows)), search="rank",
            tensors={"sids": to_msg(torch.from_numpy(b.sids[cand])[None])},
            row_tensors={"sids": to_msg(cand.astype(np.int32)[None])}))
    assert ei.value.code() == IA and "row_tensors[sids]" in ei.value.details() and "too" in ei.value.details()


@pytest.mark.asyncio(loop_scope="session")
async def test_eager_backend_matches_onnx(vstack, vbundle_dir, tmp_path):
    """The service on the eager reference backend answers what the default (ONNX Runtime) one does."""
    b = Bundle.load(vbundle_dir)
    s = VerifierSettings(host="127.0.0.1", port=0, metrics_port=0, bundle=vbundle_dir, backend="eager",
                         itemset_addr=vstack.addr("itemset"), threads=1, warmup_k=[6], log_json=False)
    runner = Runner(VerifierService(s))
    port = await runner.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            h = hist_tensor(b, [[0, 5, 9], [3, 4]])
            got = await search(stub, "beam", ref(hist=h), width=6)
            want = await search(vstack.verifier, "beam", ref(hist=h), width=6)
            assert torch.equal(out(got, "codes"), out(want, "codes"))
            assert torch.allclose(out(got, "scores"), out(want, "scores"), atol=1e-4)
    finally:
        await runner.stop(0)
