"""A gateway of this version against a verifier built before the whole searches' RPCs took the registry's names:
a real gRPC server that knows only the older names. The call is asked again under the older name, the replica is
remembered as such (until it is unreachable), and a part a bundle lacks is still told apart from an unknown RPC."""

from __future__ import annotations

from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from gateway.parts import VerifierParts
from gateway.remote import OLDER_RPC, RemoteState, RemoteVerifier
from specrec.policies.errors import DependencyDown
from specrec_rpc.v1 import verifier_pb2, verifier_pb2_grpc

SERVICE = "specrec.v1.Verifier"


@pytest.fixture
def older_verifier():
    """A server answering BeamSearch (beams of width ``request.width``) and HeadDrafts (UNIMPLEMENTED by the
    service: "no NEZHA draft head"), and nothing under the new names."""
    calls: list[str] = []

    def beam_search(request, context):
        calls.append("BeamSearch")
        return verifier_pb2.Beams(session="s1")

    def head_drafts(request, context):
        calls.append("HeadDrafts")
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "this verifier's bundle has no NEZHA draft head")

    handlers = {
        "BeamSearch": grpc.unary_unary_rpc_method_handler(
            beam_search, request_deserializer=verifier_pb2.BeamSearchRequest.FromString,
            response_serializer=verifier_pb2.Beams.SerializeToString),
        "HeadDrafts": grpc.unary_unary_rpc_method_handler(
            head_drafts, request_deserializer=verifier_pb2.HeadDraftsRequest.FromString,
            response_serializer=verifier_pb2.Beams.SerializeToString),
    }
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    replica = SimpleNamespace(address=f"127.0.0.1:{port}", stub=verifier_pb2_grpc.VerifierStub(channel))
    yield replica, calls
    channel.close()
    server.stop(0)


def _remote(replica) -> tuple[RemoteVerifier, RemoteState]:
    offers = VerifierParts(SimpleNamespace(replicas={replica.address: replica}))
    ver = RemoteVerifier(SimpleNamespace(), offers, None, [4, 4])
    return ver, RemoteState(history=None, replica=replica)


def test_an_unknown_registry_name_is_asked_again_under_its_older_name_and_remembered(older_verifier):
    replica, calls = older_verifier
    ver, st = _remote(replica)
    resp = ver._invoke(st, "Beam", verifier_pb2.BeamSearchRequest(width=3))
    assert resp.session == "s1" and calls == ["BeamSearch"]
    assert ver.offers.answers_older_names(replica.address)
    ver._invoke(st, "Beam", verifier_pb2.BeamSearchRequest(width=3))  # straight to the older name now
    assert calls == ["BeamSearch", "BeamSearch"]
    ver.offers.forget(replica.address)  # unreachable once: it may come back upgraded
    assert not ver.offers.answers_older_names(replica.address)


def test_a_part_the_bundle_lacks_stays_unimplemented_under_either_name(older_verifier):
    replica, calls = older_verifier
    ver, st = _remote(replica)
    with pytest.raises(DependencyDown) as ei:
        ver._invoke(st, "Head", verifier_pb2.HeadDraftsRequest(width=3))
    assert ei.value.code == "UNIMPLEMENTED" and "no NEZHA draft head" in str(ei.value)
    assert calls == ["HeadDrafts"]  # asked once more under the older name, which the service refused itself
    with pytest.raises(DependencyDown, match="Method not found"):  # no older name to fall back on
        ver._invoke(st, "Release", verifier_pb2.ReleaseRequest())
    assert set(OLDER_RPC) == {"Beam", "Head", "Draft", "DraftScored", "Strict", "Rank"}
