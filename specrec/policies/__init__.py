"""Policies: named strategies combining drafter, verifier and item set.

``beam``, ``fused``, ``specgr``, ``nezha``, ``strict``, ``relaxed``, ``sample``,
``drafter`` (the drafter alone) and ``auto`` (per request, the most accurate
that fits the budget); see DESIGN.md and each module's docstring.
``make_policy(name, engine, **params)`` builds one; ``POLICIES`` lists them.
"""

from . import auto, beam, drafter, fused, nezha, relaxed, sample, specgr, strict  # noqa: F401  (registration)
from .auto import Overloaded
from .base import POLICIES, Engine, Policy, RecRequest, RecResult, make_policy
from .metrics import RequestStats, SpecMetrics

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
