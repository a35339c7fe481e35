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


def call(exc, done=False):
    svc, ctx = Servicer(exc), Context(done)

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
    def __init__(self, code, details=""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code,unreachable", [
    (grpc.StatusCode.UNAVAILABLE, True),  # down: the gateway stops keeping time back for it
    (grpc.StatusCode.INVALID_ARGUMENT, False),  # answered, but refused (e.g. one catalogue version behind)
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
])
def test_a_dependency_that_refused_is_not_counted_as_down(code, unreachable):
    from gateway.remote import DependencyDown, _raise_for

    with pytest.raises(DependencyDown) as e:
        _raise_for("drafter", RpcError(code, "no item of the history is in the catalogue"))
    assert e.value.which == "drafter" and e.value.unreachable is unreachable
