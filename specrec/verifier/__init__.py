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
- ``beam_step``: one more level of the session's own constrained beam search
  (all of it: the target's whole search, below). A step reads the distributions earlier
  passes already verified and computes only the missing beams; a session that
  verified nothing steps with the KV cache. ``rule`` picks the beams: the exact
  top-k, or the relaxed rule that prefers drafted codes
  the target finds good enough;
- ``head_logprobs``: NEZHA draft-head distributions (one extra decoder pass
  per session, cached);
- ``search``: any whole search of the registry
  (:data:`~specrec.decoding.searches.SEARCHES`) in one call, by its name, its
  static widths and its named tensors (``beam``, the head's and the distilled
  drafter's searches, ``strict``, the scoring pass ``rank``).

:class:`LocalVerifier` runs in-process on a :mod:`backend <specrec.backends>`.
Its batched operations have one path, :class:`~specrec.verifier.runner.Runner` (which the verifier
service's batcher also runs over the jobs of many callers): an in-process call
is a batch of one job. The verifier service exposes the same operations over
gRPC and the gateway's remote verifier implements this interface against it,
so policies run unchanged. Every implementation reports, per beam step, how
many beams were read from verified passes (:attr:`Session.coverage`).

The package: :mod:`.types` (the interface and its values), :mod:`.jobs` (the job types and which can share a
computation), :mod:`.runner` (:class:`~.runner.Runner`, which runs them), :mod:`.local` (:class:`LocalVerifier`),
:mod:`.device` (which errors mean the device failed: :class:`DeviceFailure`).
"""

from __future__ import annotations

from ..decoding.searches import Drafted
from .device import DeviceFailure, device_failure
from .local import LocalVerifier
from .types import Parts, SelectRule, Session, SessionStateError, StepCoverage, Verifier

__all__ = ["DeviceFailure", "Drafted", "LocalVerifier", "Parts", "SelectRule", "Session", "SessionStateError",
           "StepCoverage", "Verifier", "device_failure"]
