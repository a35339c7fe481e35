"""The failures the policy loop and its fallback ladder tell apart.

Adapters (the gateway's gRPC-backed verifier and drafter) raise these, the
fallback ladder (:mod:`.fallback`) decides what answers instead, and ``auto``
raises :class:`Overloaded`. No gRPC here: an adapter names the status it got
as a string (``code``)."""

from __future__ import annotations

from typing import Any


class DependencyDown(RuntimeError):
    """A dependency gave no usable answer. ``unreachable``: it is down (no replica, or UNAVAILABLE),
    as opposed to one that answered but refused the call (e.g. a drafter one catalogue version behind).
    ``code``: the status the adapter got, by name (e.g. ``"UNIMPLEMENTED"``), when it got one. ``partial``: as
    :class:`BudgetExceeded`'s, the list the policy had in hand when the dependency failed."""

    def __init__(self, which: str, detail: str, unreachable: bool = True, code: str = ""):
        super().__init__(f"{which} unavailable: {detail}")
        self.which = which
        self.unreachable = unreachable
        self.code = code
        self.partial: Any = None  # a RecResult (typed loosely: errors know no policies)


class BudgetExceeded(RuntimeError):
    """A dependency did not answer before the request's deadline. ``partial``: the best list the policy had
    when it did not (for one request: ``fused``'s drafts, which the verifier had no time to rank), which the
    fallback ladder answers with instead of asking anyone again; None when it had none."""

    def __init__(self, which: str, detail: str):
        super().__init__(f"{which}: {detail}")
        self.which = which
        self.partial: Any = None  # a RecResult (typed loosely: errors know no policies)


class Unsupported(ValueError):
    """A policy cannot run on what the engine has: a part the verifier's bundle lacks (the distilled SID
    drafter, the NEZHA head; :class:`~specrec.verifier.Parts`) or an item drafter. Raised before any call is
    made; the gateway answers FAILED_PRECONDITION, and ``auto`` never picks such a policy."""

    def __init__(self, policy: str, missing: str):
        super().__init__(f"policy {policy!r} cannot run here: it needs {missing}")
        self.policy, self.missing = policy, missing


class Overloaded(RuntimeError):
    """No policy can answer within the request's budget."""
