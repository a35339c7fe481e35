"""The contract a backend team reads first, recommender.proto, says what the gateway has (issue 68): every
policy of the registry with its parameters, and only the settings the gateway has where its errors name one."""

from __future__ import annotations

import re
from pathlib import Path

from specrec.policies import POLICIES

PROTO = Path(__file__).resolve().parents[2] / "protos" / "specrec" / "v1" / "recommender.proto"


def documented_policies(proto: str) -> dict[str, list[str]]:
    """The policies the comment on ``RecommendRequest.policy`` lists (``//   name  what it does``), each with
    the parameters of its ``params:`` line, in the order listed."""
    block = re.search(r"\n((?:  //.*\n)+)  string policy = 4;", proto)
    assert block, "no comment above RecommendRequest.policy"
    out: dict[str, list[str]] = {}
    name = None
    for line in block.group(1).splitlines():
        if m := re.match(r"  //   (\w+) {2,}\S", line):
            name = m.group(1)
            assert name not in out, f"{name} listed twice"
            out[name] = []
        elif name and (m := re.match(r"  // {3,}params: (.*)$", line)):
            out[name] = [] if m.group(1).strip() == "none" else [p.strip() for p in m.group(1).split(",")]
    return out


def test_the_protos_policies_are_the_registrys_with_their_parameters():
    documented = documented_policies(PROTO.read_text())
    assert sorted(documented) == sorted(POLICIES)
    for name, cls in POLICIES.items():
        assert documented[name] == list(cls.Config.model_fields), f"{name}'s params in recommender.proto"


def test_the_policy_check_can_fail():
    proto = PROTO.read_text()
    fewer = re.sub(r"  //   fused .*\n(  //  {5,}.*\n)*", "", proto)
    assert "fused" not in documented_policies(fewer) and sorted(documented_policies(fewer)) != sorted(POLICIES)
    renamed = proto.replace("params: width, n_drafts, drafter, threshold, top_k", "params: width, top_k")
    assert documented_policies(renamed)["relaxed"] == ["width", "top_k"]


def test_the_settings_the_errors_name_are_the_gateways():
    from gateway.settings import GatewaySettings

    errors = re.search(r"\n((?://.*\n)+)service Recommender \{", PROTO.read_text())
    assert errors and "INVALID_ARGUMENT" in errors.group(1)
    named = set(re.findall(r"\b((?:max|default|reply|policy)_[a-z_]+)\b", errors.group(1)))
    assert {"max_k", "max_budget_ms", "max_history_items", "max_batch", "max_concurrent_rpcs"} <= named
    assert named <= set(GatewaySettings.model_fields), sorted(named - set(GatewaySettings.model_fields))
