"""Policies: named strategies combining drafter, verifier and item set.

``beam``, ``specgr``, ``nezha``, ``strict``, ``relaxed``, ``sample``; see
DESIGN.md and each module's docstring. ``make_policy(name, engine, **params)``
builds one; ``POLICIES`` lists them.
"""

from . import beam, nezha, relaxed, sample, specgr, strict  # noqa: F401  (registration)
from .base import POLICIES, Engine, Policy, RecRequest, RecResult, make_policy
from .metrics import RequestStats, SpecMetrics

__all__ = ["POLICIES", "Engine", "Policy", "RecRequest", "RecResult", "RequestStats", "SpecMetrics", "make_policy"]
