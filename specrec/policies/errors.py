"""The failures the policy loop and its fallback ladder tell apart.

Adapters (the gateway's gRPC-backed verifier and drafter) raise these, the
fallback ladder (:mod:`.fallback`) decides what answers instead, and ``auto``
raises :class:`Overloaded`. No gRPC here: an adapter names the status it got
as a string (``code``)."""

from __future__ import annotations


class DependencyDown(RuntimeError):
    """A dependency gave no usable answer. ``unreachable``: it is down (no replica, or UNAVAILABLE),
    as opposed to one that answered but refused the call (e.g. a drafter one catalogue version behind).
    ``code``: the status the adapter got, by name (e.g. ``"UNIMPLEMENTED"``), when it got one."""

    def __init__(self, which: str, detail: str, unreachable: bool = True, code: str = ""):
        super().__init__(f"{which} unavailable: {detail}")
        self.which = which
        self.unreachable = unreachable
        self.code = code


class BudgetExceeded(RuntimeError):
    """A dependency did not answer before the request's deadline (or the request was cancelled at it)."""

    def __init__(self, which: str, detail: str):
        super().__init__(f"{which}: {detail}")
        self.which = which


class Unsupported(ValueError):
    """A policy cannot run on what the engine has: a part the verifier's bundle lacks (the distilled SID
    drafter, the NEZHA head; :class:`~specrec.verifier.Parts`) or an item drafter. Raised before any call is
    made; the gateway answers FAILED_PRECONDITION, and ``auto`` never picks such a policy."""

    def __init__(self, policy: str, missing: str):
        super().__init__(f"policy {policy!r} cannot run here: it needs {missing}")
        self.policy, self.missing = policy, missing


class Overloaded(RuntimeError):
    """No policy can answer within the request's budget."""
