"""The verifier: the GR model behind a small, session-based interface.

A policy encodes a batch of histories once (:meth:`Verifier.encode` returns a
:class:`Session`) and then asks, as often as it likes and with no further
encoder work, for

- ``score``: teacher-forced log-probs of candidate SIDs, in one pass over their
  unique prefixes (a prefix tree); with ``with_frontier`` the pass also
  evaluates the session's current beam prefixes, so the next beam step costs
  nothing;
- ``score_step``: ``score`` with the frontier and the beam step read from the
  same pass, in one call (a ``specgr`` round: one verifier round trip);
- ``next_logprobs``: next-level distributions after given prefixes;
- ``beam_step``: one more level of the session's own constrained beam search,
  or ``beam_search`` for all of it. A step reads the distributions earlier
  passes already verified and computes only the missing beams; a session that
  verified nothing steps with the KV cache. ``rule`` picks the beams: the exact
  top-k (``beam``/``strict``), or the relaxed rule that prefers drafted codes
  the target finds good enough;
- ``head_*``: NEZHA draft-head distributions and beams (one extra decoder pass
  per session, cached).

:class:`LocalVerifier` runs in-process on a :mod:`backend <specrec.backends>`.
Its batched operations have one path, :func:`~specrec.verifier.local.run_jobs` (which the verifier
service's batcher also runs over the jobs of many callers): an in-process call
is a batch of one job. The verifier service exposes the same operations over
gRPC and the gateway's remote verifier implements this interface against it,
so policies run unchanged. Every implementation reports, per beam step, how
many beams were read from verified passes (:attr:`Session.coverage`).

The package: :mod:`.types` (the interface and its values), :mod:`.jobs` (the job types and which can share a
computation), :mod:`.local` (:class:`LocalVerifier` and :func:`~specrec.verifier.local.run_jobs`), :mod:`.device`
(which errors mean the device failed: :class:`DeviceFailure`).
"""

from __future__ import annotations

from .device import DeviceFailure, device_failure
from .local import LocalVerifier
from .types import Drafted, Parts, SelectRule, Session, SessionStateError, StepCoverage, Verifier

__all__ = ["DeviceFailure", "Drafted", "LocalVerifier", "Parts", "SelectRule", "Session", "SessionStateError",
           "StepCoverage", "Verifier", "device_failure"]
