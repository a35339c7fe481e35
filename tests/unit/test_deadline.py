"""One immutable deadline per request (specrec.deadline), its cancellation, and the gateway's calls that stop with it:
a call in flight on a real gRPC server is cancelled when the request is, and none is started after."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent import futures

import grpc
import pytest

from gateway.calls import call, request_calls
from specrec.costs import CostModel, CostStage
from specrec.deadline import Deadline, Watch
from specrec.policies.errors import BudgetExceeded
from specrec_rpc.v1 import verifier_pb2

SERVICE = "specrec.v1.Verifier"


def test_a_deadline_is_immutable_and_what_is_kept_back_is_a_new_one_with_the_same_watch():
    watch = Watch()
    d = Deadline(10.0, watch=watch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.reserve = 1.0  # type: ignore[misc]
    kept = d.keeping(0.5)
    assert (d.reserve, kept.reserve, kept.verifier_at, kept.at) == (0.0, 0.5, 9.5, 10.0)
    assert kept.whole().verifier_at == 10.0 and kept.whole().watch is watch and kept.watch is watch
    assert not kept.cancelled
    watch.cancel()
    assert d.cancelled and kept.cancelled and kept.whole().cancelled


def test_a_watch_runs_each_cancel_callback_once_and_one_registered_after_at_once():
    watch, ran = Watch(), []
    watch.on_cancel(lambda: ran.append("a"))
    forget = watch.on_cancel(lambda: ran.append("gone"))
    forget()  # a call that ended
    watch.cancel()
    watch.cancel()
    watch.on_cancel(lambda: ran.append("late"))
    assert ran == ["a", "late"]
    d = Deadline(1.0)  # without a watch: never cancelled, holds nothing
    d.hold(lambda: "list")
    assert not d.cancelled


def test_no_stage_fits_a_cancelled_request():
    costs = CostModel().for_policy("beam", lambda: 0.0)
    d = Deadline(100.0, watch=Watch())
    assert costs.fits(d, CostStage.SEARCH)
    d.watch.cancel()  # type: ignore[union-attr]
    assert not costs.fits(d, CostStage.SEARCH)


@contextlib.contextmanager
def describe_server(describe):
    """A real gRPC server on loopback answering the verifier's Describe with ``describe``; yields its stub."""
    handler = grpc.unary_unary_rpc_method_handler(
        describe, request_deserializer=verifier_pb2.DescribeRequest.FromString,
        response_serializer=verifier_pb2.DescribeResponse.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Describe": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.unary_unary("/specrec.v1.Verifier/Describe",
                                      request_serializer=verifier_pb2.DescribeRequest.SerializeToString,
                                      response_deserializer=verifier_pb2.DescribeResponse.FromString)
    finally:
        server.stop(0)


@pytest.fixture
def slow_server():
    """A verifier whose Describe takes 5 s unless the call ends first (its timeout, or its caller cancels); it says
    when it saw the call end."""
    started, gone = threading.Event(), threading.Event()

    def describe(request, context):
        started.set()
        context.add_callback(gone.set)  # the RPC ended
        for _ in range(500):
            if not context.is_active():
                break
            time.sleep(0.01)
        return verifier_pb2.DescribeResponse()

    with describe_server(describe) as stub:
        yield stub, started, gone


def test_a_call_ends_with_its_requests_time_and_none_starts_after_a_cancel(slow_server):
    """A call in flight ends where the request's time for it ends (its gRPC timeout, from the deadline: the
    server sees it end), and once the request is cancelled (answered) no call is sent for it."""
    stub, started, gone = slow_server
    watch = Watch()
    deadline = Deadline(time.monotonic() + 0.3, watch=watch)
    t0 = time.monotonic()
    with request_calls(), pytest.raises(BudgetExceeded):
        call("verifier", stub, verifier_pb2.DescribeRequest(), deadline, "Describe")
    assert time.monotonic() - t0 < 4.0  # not the server's 5 s
    assert gone.wait(5.0)  # the server saw the call end
    started.clear()
    watch.cancel()
    with pytest.raises(BudgetExceeded, match="cancelled"):
        call("verifier", stub, verifier_pb2.DescribeRequest(), Deadline(time.monotonic() + 10.0, watch=watch),
             "Describe")
    assert not started.wait(0.2)  # never sent


def test_a_call_carries_the_requests_metadata_and_records_its_hop():
    """Within request_calls, a call forwards the request's metadata and its hop is recorded (a call answered)."""
    seen = []

    def describe(request, context):
        seen.append(dict(context.invocation_metadata()).get("x-request-id"))
        return verifier_pb2.DescribeResponse()

    with describe_server(describe) as stub:
        deadline = Deadline(time.monotonic() + 10.0, watch=Watch())
        with request_calls((("x-request-id", "r1"),)) as hops:
            call("verifier", stub, verifier_pb2.DescribeRequest(), deadline, "Describe")
        assert seen == ["r1"] and set(hops.caller_ms) == {"Describe"}
        call("verifier", stub, verifier_pb2.DescribeRequest(), deadline, "Describe")  # outside: no metadata
        assert seen == ["r1", None]
