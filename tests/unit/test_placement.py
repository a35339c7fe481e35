"""Where the local stack runs each service (:func:`specrec_stack.localstack.placement`, ``SPECREC_STACK_PLACEMENT``):
shared confines none, split gives the verifier the upper half of the CPUs and the other services the rest."""

from __future__ import annotations

import pytest

from specrec_stack.localstack import PLACEMENTS, ServiceProcs, placement


def test_shared_confines_no_service():
    assert placement("shared", list(range(16))) == {}


@pytest.mark.parametrize("cpus, verifier, rest", [
    ([0, 1], {1}, {0}),
    ([0, 1, 2], {1, 2}, {0}),  # an odd count: the verifier, which costs a request most, has the larger half
    (list(range(16)), set(range(8, 16)), set(range(8))),
    ([2, 5, 7, 9], {7, 9}, {2, 5}),  # a cpuset of some of the machine's CPUs
])
def test_split_gives_the_verifier_the_upper_half(cpus, verifier, rest):
    got = placement("split", cpus)
    assert got == {"verifier": verifier, "itemset": rest, "drafter": rest, "gateway": rest}


def test_split_on_one_cpu_confines_nothing():
    assert placement("split", [3]) == {}


def test_an_unknown_placement_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="SPECREC_STACK_PLACEMENT"):
        placement("pinned", [0, 1])


def test_the_stack_reads_its_placement_from_its_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECREC_STACK_PLACEMENT", raising=False)
    assert ServiceProcs(tmp_path, "redis://x", "ns", tmp_path).placement == PLACEMENTS[0] == "shared"
    procs = ServiceProcs(tmp_path, "redis://x", "ns", tmp_path, env={"SPECREC_STACK_PLACEMENT": "split"})
    assert procs.placement == "split"
    monkeypatch.setenv("SPECREC_STACK_PLACEMENT", "split")
    assert ServiceProcs(tmp_path, "redis://x", "ns", tmp_path, placement="shared").cpus == {}
    with pytest.raises(ValueError):
        ServiceProcs(tmp_path, "redis://x", "ns", tmp_path, placement="everywhere")
