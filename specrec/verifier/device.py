"""A device that fails: which errors mean the verifier's device can no longer be trusted.

A GPU fails in ways a retry on the same device does not mend: a *sticky* CUDA error (an illegal memory access,
a device-side assert, a launch failure, ECC and Xid errors, a GPU that fell off the bus) leaves the process's CUDA
context broken, and every later call on it fails too; a kernel or a driver call that never returns hangs the
computing thread for good. A verifier whose device failed must leave rotation so that its callers' other
replicas answer; it must not take a healthy device out for the request's fault.

:func:`device_failure` sorts an exception raised by a backend (PyTorch's ``torch.AcceleratorError`` and
``RuntimeError``\\ s, ONNX Runtime's CUDA provider's errors, by type and by the CUDA runtime's wording) into

- a :class:`DeviceFailure`: any CUDA, cuBLAS or cuDNN error except the ones below, and a lost device;
- None, the device is fine: the call's own failure, left to the caller. Out of memory (``torch.OutOfMemoryError``,
  ``CUBLAS_STATUS_ALLOC_FAILED``: a batch too large for what is free; the next one may fit), an invalid
  argument or configuration, a parameter or feature cuBLAS/cuDNN does not support (the CUDA runtime reports these
  without breaking the context: a bug of one call's shapes), an error of a CUDA graph's capture ("operation not
  permitted when stream is capturing" and the like: a capture in another thread refused the call, or the call
  invalidated it; the context is intact), a bad request (``ValueError``, of which the
  services' ``InvalidArgument`` is one: validated before the device sees it), and every error that names no
  device at all (a shape mismatch, tensors on two devices: bugs, not failures).

A hang is not an exception: whoever runs the backend (the verifier service's batcher) times the computation and
makes the :class:`DeviceFailure` itself (:meth:`DeviceFailure.hang`).
"""

from __future__ import annotations

import re

import torch

#: the CUDA runtime's, cuBLAS's, cuDNN's and NVML's wording of a failed device (PyTorch: "CUDA error: ...",
#: "CUDA driver error: ...", "CUBLAS_STATUS_EXECUTION_FAILED when calling ...", "cuDNN error: CUDNN_STATUS_...";
#: ONNX Runtime's CUDA provider: "CUDA failure 700: ...", "CUBLAS failure 13: ...", "CUDNN failure 8: ...")
_DEVICE = re.compile(
    r"\bCUDA (?:error|failure|driver error)\b|\b(?:CUBLAS|CUDNN|cuDNN|cuBLAS) (?:error|failure)\b|"
    r"\bCU(?:BLAS|DNN)_STATUS_\w+|device-side assert|illegal memory access|unspecified launch failure|"
    r"\bGPU (?:is lost|has fallen off the bus)|\b(?:lost|lose) (?:the )?device\b|\bdevice (?:was )?lost\b|"
    r"uncorrectable ECC error|\bXid\b",
    re.IGNORECASE,
)
#: CUDA errors that leave the device usable: the call's own failure (see the module's docstring)
_NOT_THE_DEVICE = re.compile(
    r"out of memory|ALLOC_FAILED|invalid argument|invalid configuration|invalid value|"
    r"_STATUS_(?:NOT_SUPPORTED|BAD_PARAM\w*|INVALID_VALUE|ARCH_MISMATCH)|not supported|"
    r"captur(?:e|ed|ing)\b",  # a stream capture's errors (cudaErrorStreamCapture*, cudaErrorCapturedEvent)
    re.IGNORECASE,
)
_OOM = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
             if isinstance(t, type))
_ACCELERATOR = tuple(t for t in (getattr(torch, "AcceleratorError", None), getattr(torch.cuda, "CudaError", None))
                     if isinstance(t, type))


class DeviceFailure(RuntimeError):
    """The device the model computes on failed (``kind`` "error": a sticky CUDA error or a lost device; "hang":
    a computation that never ended): nothing more should be computed on it."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"device failed ({kind}): {detail}")
        self.kind, self.detail = kind, detail

    @classmethod
    def hang(cls, seconds: float, limit_s: float) -> DeviceFailure:
        return cls("hang", f"a batch has computed for {seconds:.1f} s, past the {limit_s:g} s watchdog")


def device_failure(exc: BaseException) -> DeviceFailure | None:
    """The :class:`DeviceFailure` ``exc`` stands for (itself, or one that its cause or context stands for), or
    None when the device is fine (see the module's docstring)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(seen) < 8:
        seen.add(id(e))
        found = _one(e)
        if found is not None:
            return found
        e = e.__cause__ or e.__context__
    return None


def _one(e: BaseException) -> DeviceFailure | None:
    if isinstance(e, DeviceFailure):
        return e
    if isinstance(e, ValueError) or (_OOM and isinstance(e, _OOM)):
        return None
    text = str(e)
    if _NOT_THE_DEVICE.search(text):
        return None
    if (_ACCELERATOR and isinstance(e, _ACCELERATOR)) or _DEVICE.search(text):
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        return DeviceFailure("error", f"{type(e).__name__}: {first}")
    return None
