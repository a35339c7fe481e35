"""The one error model (specrec_rpc.errors): exception -> status, INTERNAL without details, and
nothing sent (nor logged as a fault) when the caller has already gone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specrec_rpc.errors import InvalidArgument, handle_errors


class Context:
    """The part of grpc.aio.ServicerContext that handle_errors uses."""

    def __init__(self, done: bool = False):
        self._done, self.aborted = done, None

    def done(self) -> bool:
        return self._done

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()

    async def abort_with_status(self, status):
        self.aborted = (status.code, status.details)
        self.status = status
        raise grpc.aio.AbortError()


class Log:
    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda event, **kw: self.lines.append((level, event, kw))


class Servicer:
    def __init__(self, exc):
        self.exc, self.log = exc, Log()

    @handle_errors
    async def Call(self, request, context):
        raise self.exc


def call(exc, done=False, ctx=None):
    svc, ctx = Servicer(exc), ctx or Context(done)

    async def go():
        try:
            await svc.Call(None, ctx)
        except grpc.aio.AbortError:
            pass

    asyncio.run(go())
    return svc.log.lines, ctx.aborted


def test_a_known_error_gets_its_code_and_message():
    lines, aborted = call(InvalidArgument("k", "must be 1..100"))
    assert aborted == (grpc.StatusCode.INVALID_ARGUMENT, "k: must be 1..100")
    assert not [x for x in lines if x[0] == "error"]


def test_an_unexpected_error_is_internal_without_details_and_logged():
    lines, aborted = call(KeyError("secret-detail"))
    assert aborted[0] == grpc.StatusCode.INTERNAL and "secret-detail" not in aborted[1]
    assert [x[1] for x in lines if x[0] == "error"] == ["unhandled error"]


@pytest.mark.parametrize("exc", [TimeoutError("deadline passed while queued"), KeyError("x")])
def test_a_call_whose_caller_has_gone_is_not_answered_nor_logged_as_a_fault(exc):
    lines, aborted = call(exc, done=True)
    assert aborted is None  # aborting a finished call raises inside grpc (it was logged as "unhandled")
    assert not [x for x in lines if x[0] in ("error", "warning")]


class RpcError(grpc.RpcError):
    def __init__(self, code, details="", trailing_metadata=None):
        self._code, self._details, self._trailing = code, details, trailing_metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


class SessionGone(LookupError):
    pass


def test_a_reason_travels_in_the_status_details_and_the_client_reads_it_from_there():
    """An error registered with a reason aborts with google.rpc.ErrorInfo(reason, domain) in the details;
    the gateway's client raises SessionLost from that reason alone."""
    from gateway.calls import SessionLost, raise_for
    from specrec_rpc.errors import DOMAIN, Reason, reason_of_rpc, register

    register(SessionGone, grpc.StatusCode.FAILED_PRECONDITION, reason=Reason.SESSION_LOST)
    ctx = Context()
    _, aborted = call(SessionGone("it expired"), ctx=ctx)
    assert aborted == (grpc.StatusCode.FAILED_PRECONDITION, "it expired")
    err = RpcError(ctx.status.code, ctx.status.details, ctx.status.trailing_metadata)
    assert reason_of_rpc(err) == Reason.SESSION_LOST and DOMAIN == "specrec"
    with pytest.raises(SessionLost):
        raise_for("verifier", err)


def test_a_message_that_mentions_a_session_is_not_a_lost_session():
    """Without the SESSION_LOST reason a FAILED_PRECONDITION is a refusal, whatever its text says."""
    from gateway.calls import raise_for
    from specrec.policies.errors import DependencyDown
    from specrec_rpc.errors import reason_of_rpc

    err = RpcError(grpc.StatusCode.FAILED_PRECONDITION, "session: its beam search is already complete")
    assert reason_of_rpc(err) is None
    with pytest.raises(DependencyDown) as e:
        raise_for("verifier", err)
    assert e.value.code == "FAILED_PRECONDITION" and not e.value.unreachable


def test_a_reason_of_another_domain_or_unknown_to_the_client_is_none():
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    from specrec_rpc.errors import reason_of_rpc

    for domain, reason in (("example.com", "SESSION_LOST"), ("specrec", "NOT_A_REASON_WE_KNOW")):
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=domain))
        st = rpc_status.to_status(status_pb2.Status(code=9, message="m", details=[info]))
        assert reason_of_rpc(RpcError(st.code, st.details, st.trailing_metadata)) is None


@pytest.mark.parametrize("code,unreachable", [
    (grpc.StatusCode.UNAVAILABLE, True),  # down: the gateway stops keeping time back for it
    (grpc.StatusCode.INVALID_ARGUMENT, False),  # answered, but refused (e.g. one catalogue version behind)
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
])
def test_a_dependency_that_refused_is_not_counted_as_down(code, unreachable):
    from gateway.calls import raise_for
    from specrec.policies.errors import DependencyDown

    with pytest.raises(DependencyDown) as e:
        raise_for("drafter", RpcError(code, "no item of the history is in the catalogue"))
    assert e.value.which == "drafter" and e.value.unreachable is unreachable
