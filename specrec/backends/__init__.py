"""Backends for the GR model's serving hot path (see :mod:`.base`).

``onnx`` (ONNX Runtime, fused graphs and whole-search graphs) is the
default: the fastest measured on our CPU (``bench/backends.py``; torch.compile
was measured too and left out: no faster than eager here, and minutes of
compilation per shape). ``eager`` is plain PyTorch, the reference every test
compares against. ``cuda`` is the GPU's: the whole searches captured as CUDA
graphs (:mod:`.cuda`). ``make_backend(name, model, head)`` builds one by name;
``BACKENDS`` lists them; ``DEFAULT_BACKEND`` is the default.
"""

from __future__ import annotations

from .base import Backend
from .cuda import CudaBackend
from .onnx import OrtBackend

BACKENDS = {"eager": Backend, "onnx": OrtBackend, "cuda": CudaBackend}


DEFAULT_BACKEND = "onnx"


def make_backend(name: str, model, head=None, **kw) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(sorted(BACKENDS))})")
    return BACKENDS[name](model, head, **kw)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Backend", "CudaBackend", "OrtBackend", "make_backend"]
