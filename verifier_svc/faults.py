"""Fault injection for tests and drills: a verifier whose device fails or hangs on purpose (the GPU failures of
:mod:`specrec.verifier.device`, made on any machine)."""

from __future__ import annotations

import threading

import torch

from .settings import VerifierSettings


class Faults:
    """Fault injection (``fault_device_error_after``, ``fault_hang_after``): after that many batches computed while
    serving, every batch fails with the CUDA error a failed GPU raises, or the next one hangs until the service
    stops. Counted once ``armed`` (after the warm-up)."""

    def __init__(self, s: VerifierSettings):
        self.error_after, self.hang_after = s.fault_device_error_after, s.fault_hang_after
        self.armed = False
        self.batches = 0
        self._released = threading.Event()

    def before_batch(self) -> None:
        if not self.armed or not (self.error_after or self.hang_after):
            return
        self.batches += 1
        if self.error_after and self.batches > self.error_after:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (fault injected: "
                                         "fault_device_error_after)")
        if self.hang_after and self.batches == self.hang_after + 1:
            self._released.wait()  # a hung kernel, until stop() lets the thread go

    def release(self) -> None:
        self._released.set()
