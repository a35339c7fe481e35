"""A request's deadline, held in one object.

The policy loop reads :attr:`Deadline.at` (its budget hook); a serving layer
that keeps time back for a fallback's answer (the gateway keeps some for the
drafter) sets :attr:`Deadline.reserve`, and the verifier's calls end at
:attr:`Deadline.verifier_at`. A fallback that no longer needs the reserve
(the drafter is down, the verifier answers instead) drops it
(:meth:`Deadline.drop_reserve`), and every holder of the object sees it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Deadline:
    at: float  # absolute time on the engine's clock (seconds)
    reserve: float = 0.0  # seconds before ``at`` at which the verifier's calls end

    @property
    def verifier_at(self) -> float:
        return self.at - self.reserve

    def left(self, now: float) -> float:
        """Seconds until ``at`` (negative once passed)."""
        return self.at - now

    def drop_reserve(self) -> None:
        self.reserve = 0.0
