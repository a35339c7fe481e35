"""Policies plan with what the verifier's bundle offers (specrec.verifier.Parts): on a bundle with the GR
model alone every policy that can run does so, with no call it cannot answer; the one that cannot is refused
by name (Unsupported), ``auto`` never picks it; a call refused as UNIMPLEMENTED is no verifier failure."""

from __future__ import annotations

import time

import grpc
import pytest

from gateway.parts import VerifierParts
from specrec.deadline import Deadline
from specrec.decoding.searches import SEARCHES
from specrec.policies import RecRequest, make_policy
from specrec.policies.auto import AutoPolicy
from specrec.policies.breaker import Breaker, Cooldown
from specrec.policies.errors import DependencyDown, Unsupported
from specrec.policies.fallback import Ladder
from specrec.verifier import Parts
from specrec_rpc.v1 import verifier_pb2

from .policy_fixtures import histories, make_engine


def refuse(verifier, *methods):
    """Calls the bundle cannot answer fail the test if a policy makes them: ``methods``, and the searches of the
    registry that use the NEZHA head or the distilled drafter."""
    def boom(*a, **kw):
        raise AssertionError("a policy called a part the verifier's bundle lacks")

    for m in methods:
        setattr(verifier, m, boom)
    real = verifier.search

    def search(sess, name, *a, **kw):
        if SEARCHES[name].uses_head or SEARCHES[name].uses_sid_drafter:
            boom()
        return real(sess, name, *a, **kw)

    verifier.search = search


def model_only():
    eng = make_engine(40, with_head=False)
    assert eng.verifier.parts() == Parts(distilled_drafter=False, draft_head=False)
    refuse(eng.verifier, "head_logprobs")
    return eng


@pytest.mark.parametrize("policy", ["strict", "specgr"])
def test_a_model_only_bundle_serves_the_policies_it_can_with_the_item_drafter(policy):
    eng = model_only()
    hists = histories(eng, 4, 40)
    beam = make_policy("beam", eng).run([RecRequest(h, 5) for h in hists])
    got = make_policy(policy, eng).run([RecRequest(h, 5) for h in hists])
    assert all(r.served_by == policy and not r.degraded and len(r.items) == 5 for r in got)
    if policy == "strict":  # drafted by the item drafter, still the target's own list
        assert [r.items.tolist() for r in got] == [r.items.tolist() for r in beam]


@pytest.mark.parametrize(("policy", "params", "named"), [
    ("nezha", {}, "SID drafter"),
    ("nezha", {"drafter": "head"}, "NEZHA draft head"),
    ("strict", {"drafter": "distilled"}, "distilled SID drafter"),
    ("specgr", {"first_drafter": "distilled"}, "distilled SID drafter"),
])
def test_a_policy_that_cannot_run_is_refused_naming_the_missing_part(policy, params, named):
    eng = model_only()
    p = make_policy(policy, eng, **params)
    assert named in p.missing()
    with pytest.raises(Unsupported, match=named):
        p.run([RecRequest(histories(eng, 1)[0], 5)])


def test_the_item_drafter_missing_is_named_too():
    eng = model_only()
    eng.drafter = None
    assert "item drafter" in make_policy("drafter", eng).missing()
    assert "drafter" in make_policy("strict", eng).missing()
    assert make_policy("beam", eng).missing() is None


def test_auto_offers_only_what_can_run():
    eng = model_only()
    auto = AutoPolicy(eng)
    assert auto.runnable() == [["beam", "strict"], ["drafter"]]
    for _ in range(20):  # whatever the estimates, nezha is never chosen
        assert auto.choose(RecRequest(histories(eng, 1)[0], 5, Deadline(eng.clock() + 0.0001))) != "nezha"
    eng.drafter = None
    assert auto.runnable() == [["beam"]]  # strict has nothing to draft with either


def test_a_part_refused_as_unimplemented_falls_back_to_beam_and_leaves_the_breaker_closed():
    eng = make_engine(41)  # the parts are believed there (as for a replica not described yet)
    t = [0.0]
    eng.clock = lambda: t[0]
    breaker = Breaker(1, 1.0, clock=eng.clock)
    ladder = Ladder(breaker, Cooldown(1.0, clock=eng.clock), eng.costs)

    real = eng.verifier.search

    def unimplemented(sess, name, *a, **kw):
        if SEARCHES[name].uses_head:
            raise DependencyDown("verifier", "UNIMPLEMENTED: no NEZHA draft head", code="UNIMPLEMENTED")
        return real(sess, name, *a, **kw)

    eng.verifier.search = unimplemented
    h = histories(eng, 1, 41)[0]
    for _ in range(3):  # one failure would open this breaker
        res = ladder.answer("nezha", {}, eng, RecRequest(h, 5, Deadline(t[0] + 1.0)))
        assert res.served_by == "beam" and "verifier part unavailable: beam answered" in res.degraded
    assert not breaker.is_open()


class FakeStub:
    def __init__(self, answer):
        self.answer, self.asked = answer, 0

    def Describe(self, request, timeout=None):  # noqa: N802 - the RPC's name
        self.asked += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class FakeRpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


class FakeReplica:
    def __init__(self, address, stub):
        self.address, self.stub = address, stub


class FakeReplicas:
    def __init__(self, **stubs):
        self.replicas = {a: FakeReplica(a, s) for a, s in stubs.items()}


def test_verifier_parts_are_what_every_replica_said():
    full = FakeStub(verifier_pb2.DescribeResponse(distilled_drafter=True, draft_head=True))
    bare = FakeStub(verifier_pb2.DescribeResponse(distilled_drafter=False, draft_head=True))
    parts = VerifierParts(FakeReplicas(a=full, b=bare), retry_s=3600)
    assert parts.describe_all() == {"a": Parts(True, True), "b": Parts(False, True)}
    assert parts.current() == Parts(distilled_drafter=False, draft_head=True)
    parts.lacks("a", "draft_head")
    assert parts.current() == Parts(False, False)
    parts.forget("a")  # unreachable: asked again (here in the background thread current() starts)
    parts.current()
    for _ in range(200):
        if full.asked == 2 and parts.current() == Parts(False, True):
            break
        time.sleep(0.01)
    assert full.asked == 2 and parts.current() == Parts(False, True)


def test_a_replica_that_does_not_describe_itself_counts_as_complete_until_it_refuses_a_call():
    old = FakeStub(FakeRpcError(grpc.StatusCode.UNIMPLEMENTED))
    parts = VerifierParts(FakeReplicas(a=old), retry_s=3600)
    assert parts.describe_all() == {}
    assert parts.current() == Parts()
    assert old.asked == 1  # not asked again before retry_s
    parts.lacks("a", "distilled_drafter")
    assert parts.current() == Parts(distilled_drafter=False, draft_head=True)
