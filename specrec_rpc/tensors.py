"""numpy / torch arrays <-> ``specrec.v1.Tensor`` messages (raw little-endian bytes)."""

from __future__ import annotations

import numpy as np
import torch

from .v1 import common_pb2

_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_}


class TensorError(ValueError):
    pass


def to_msg(x) -> common_pb2.Tensor:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    name = {np.dtype(v): k for k, v in _DTYPES.items()}.get(a.dtype)
    if name is None:
        raise TensorError(f"unsupported dtype {a.dtype}")
    return common_pb2.Tensor(
        shape=list(a.shape),
        dtype=name,
        data=np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes(),
    )


def from_msg(
    m: common_pb2.Tensor, field: str = "tensor", dtype: str | None = None, ndim: int | None = None
) -> np.ndarray:
    """Decode and validate (errors name ``field``)."""
    if dtype is not None and m.dtype != dtype:
        raise TensorError(f"{field}: dtype must be {dtype}, got {m.dtype or 'none'}")
    if m.dtype not in _DTYPES:
        raise TensorError(f"{field}: unknown dtype {m.dtype!r}")
    shape = tuple(int(s) for s in m.shape)
    if ndim is not None and len(shape) != ndim:
        raise TensorError(f"{field}: expected {ndim} dimensions, got shape {list(shape)}")
    if any(s < 0 for s in shape):
        raise TensorError(f"{field}: negative dimension in {list(shape)}")
    dt = np.dtype(_DTYPES[m.dtype]).newbyteorder("<")
    n = int(np.prod(shape)) if shape else 1
    if len(m.data) != n * dt.itemsize:
        raise TensorError(f"{field}: {len(m.data)} bytes do not fill shape {list(shape)} of {m.dtype}")
    return np.frombuffer(m.data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="), copy=False)


def to_torch(
    m: common_pb2.Tensor, field: str = "tensor", dtype: str | None = None, ndim: int | None = None
) -> torch.Tensor:
    return torch.from_numpy(np.array(from_msg(m, field, dtype, ndim)))
