"""Policies: named strategies combining drafter, verifier and item set.

``beam``, ``fused``, ``specgr``, ``nezha``, ``strict``, ``relaxed``, ``sample``,
``drafter`` (the drafter alone) and ``auto`` (per request, the most accurate
that fits the budget); see DESIGN.md and each module's docstring.
``make_policy(name, engine, **params)`` builds one; ``POLICIES`` lists them.
"""

from . import auto, beam, drafter, fused, nezha, relaxed, sample, specgr, strict  # noqa: F401  (registration)
from .auto import Overloaded
from .base import POLICIES, Policy, make_policy
from .engine import Engine
from .metrics import RequestStats, SpecMetrics
from .requests import RecRequest, RecResult

__all__ = [
    "POLICIES",
    "Engine",
    "Overloaded",
    "Policy",
    "RecRequest",
    "RecResult",
    "RequestStats",
    "SpecMetrics",
    "make_policy",
]
