"""Capture once, replay many: each (search, widths, batch bucket) a CUDA graph over static buffers.

vLLM's ``CUDAGraphRunner`` is the model: a graph is captured once per key over *static* input and output
buffers; a call copies its inputs into the key's input buffers, replays the graph (one launch instead of the
few hundred small kernels an eager pass launches from Python) and copies the outputs out before anything
replays again. Graphs share one memory pool (captured largest first, so the smaller ones reuse its memory), so
every replay and copy-out runs under one lock (:attr:`GraphRunner.lock`), which also serialises every other
use of the device.

Rows are bucketed (the owner's sizes, e.g. 1, 2, 4, 8, 16, 32, 64, as vLLM captures batch sizes): a call of
``n`` rows runs the graph of the smallest bucket that holds them (:func:`bucket`). Each input names its row axis;
the call copies its ``n`` real rows into the buffer's first ``n`` and leaves the rest as they were: every buffer is made
from real inputs (the first call's, repeated along the row axis), and every row of a search is computed on its
own, so a padding row only ever holds some earlier request's valid data and nothing reads what it gives.
Calls of more rows than the largest bucket run in chunks of it.

A capture runs under that lock too, on a stream of its own, in CUDA's thread-local capture mode: another thread's
device work (a batch being assembled, a search's selects) is not refused while it runs, and the thread's current
stream is restored however the capture ends (:func:`_capturing`; ``torch.cuda.graph`` leaves the thread on its
capture stream when ``capture_end`` raises). The graphs' memory is what they hold, counted from the allocator's
own segments (:func:`pool_bytes`): their static input buffers and the shared pool their outputs and intermediates
live in.

``capture=False`` is the stand-in that CI runs on the CPU: the same buffers, buckets, copies and chunks, with
the function run eagerly over the static buffers instead of a replay. A key whose capture fails (an operation a
graph cannot hold) runs eagerly on the device from then on, and :attr:`GraphRunner.eager` says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: what a graph computes: static inputs -> outputs (a tuple of tensors)
GraphFn = Callable[..., Sequence[torch.Tensor]]


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n``; ``n`` > the largest is the caller's to chunk."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} rows do not fit the largest bucket ({sizes[-1]})")


def pool_bytes(segments: Iterable[dict], pool: Sequence[int], device: int) -> int:
    """Device memory a graph pool holds: the sizes of the caching allocator's segments
    (``torch.cuda.memory_snapshot()``) that belong to ``pool`` on ``device``. A sum of what is reserved now: it never
    counts another pool's memory or what ``empty_cache`` gave back, and is never negative."""
    want = tuple(pool)
    return sum(int(s["total_size"]) for s in segments
               if tuple(s.get("segment_pool_id", ())) == want and int(s.get("device", device)) == device)


def tensor_bytes(xs: Iterable[torch.Tensor]) -> int:
    return sum(x.numel() * x.element_size() for x in xs)


@contextmanager
def _on_stream(stream, device: torch.device) -> Iterator[None]:
    """The block's device work on ``stream`` (on ``device``); the thread's current stream set back however the block
    ends (``torch.cuda.graph`` does not: when ``capture_end`` raises, it leaves the thread on its capture stream)."""
    before = torch.cuda.current_stream(device)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(before)


@contextmanager
def _capturing(graph, stream, device: torch.device, pool) -> Iterator[None]:
    """Capture the block's device work into ``graph`` on ``stream``, in thread-local capture mode (only this
    thread's unsafe calls are refused: another thread's device work goes on), the capture ended and the stream
    set back however the block ends."""
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext(), _on_stream(stream, device):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def chunks(n: int, largest: int) -> list[tuple[int, int]]:
    """Row spans [a, b) of at most ``largest`` rows covering ``n``."""
    return [(a, min(n, a + largest)) for a in range(0, n, largest)]


@dataclass(frozen=True)
class Feed:
    """One input of a graph call: the tensor (its real rows only) and its row axis."""

    tensor: torch.Tensor
    axis: int = 0


def _grown(x: torch.Tensor, axis: int, rows: int) -> torch.Tensor:
    """A new buffer: ``x`` with its row axis grown to ``rows`` by repeating its first row (valid data in every row).
    Never ``x`` itself: a static buffer is written by every later call, and ``x`` is the caller's."""
    have = x.shape[axis]
    if have == rows:
        return x.clone(memory_format=torch.contiguous_format)
    reps = [1] * x.dim()
    reps[axis] = rows - have
    return torch.cat([x, x.narrow(axis, 0, 1).repeat(*reps)], axis)


@dataclass
class Graph:
    """A captured (or, in the stand-in, prepared) graph: its static buffers and, on a GPU, the graph itself."""

    fn: GraphFn
    inputs: list[torch.Tensor]  # static input buffers, rows = the bucket
    axes: list[int]  # each input's row axis
    outputs: Sequence[torch.Tensor]  # static outputs (the stand-in: the last call's)
    graph: torch.cuda.CUDAGraph | None


class GraphRunner:
    """The captured graphs of one device, by key; see the module's docstring."""

    def __init__(self, device: torch.device, capture: bool):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device, self.capture = device, capture
        self.graphs: dict[tuple, Graph] = {}
        self.eager: dict[tuple, str] = {}  # keys that run eagerly -> why
        self.capture_s = 0.0  # seconds spent capturing, all keys together
        self.buffer_bytes = 0  # the graphs' static input buffers (the stand-in's too)
        self.pool_bytes = 0  # the shared pool, as the allocator held it after the latest capture
        self.captured_after_start = 0  # keys captured by a call, not by the warm-up (each a slow call)
        self.started = False  # set by the owner once its warm-up is done
        self.lock = threading.RLock()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._capture_stream: torch.cuda.Stream | None = None  # made on the first capture

    def __len__(self) -> int:
        return len(self.graphs)

    def memory_mb(self) -> float:
        """Memory the graphs hold: their static input buffers and the pool their captures allocated in (the
        stand-in: its buffers alone)."""
        return (self.buffer_bytes + self.pool_bytes) / 2**20

    def _pool_bytes(self) -> int:
        if self.pool is None:
            return 0
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return pool_bytes(torch.cuda.memory_snapshot(), self.pool, index)

    def drop(self, stale: Callable[[tuple], bool]) -> int:
        """Forget the graphs whose key is ``stale`` (they read buffers that were replaced) -> how many."""
        with self.lock:
            gone = [k for k in self.graphs if stale(k)]
            for k in gone:
                self.buffer_bytes -= tensor_bytes(self.graphs.pop(k).inputs)
            return len(gone)

    def run(self, key: tuple, fn: GraphFn, feeds: Sequence[Feed], rows: int, out_axes: Sequence[int],
            to_host: Sequence[bool]) -> list[torch.Tensor]:
        """Graph ``key`` (captured from ``fn`` on its first call) over ``feeds``, whose ``rows`` real rows fill
        the first of the key's bucket (the caller put the bucket in ``key`` and chose it with :func:`bucket`).
        -> the outputs' first ``rows`` rows along ``out_axes``, each on the host where ``to_host`` says so,
        else a copy on the device (the static outputs are overwritten by the next replay)."""
        with self.lock, torch.inference_mode():
            if key in self.eager:
                outs = fn(*[f.tensor.to(self.device) for f in feeds])
                return [_out(o, a, rows, h) for o, a, h in zip(outs, out_axes, to_host)]
            g = self.graphs.get(key)
            if g is None:
                g = self._make(key, fn, feeds, rows)
                if g is None:
                    return self.run(key, fn, feeds, rows, out_axes, to_host)
                made = True
            else:
                for buf, f, axis in zip(g.inputs, feeds, g.axes):
                    buf.narrow(axis, 0, rows).copy_(f.tensor, non_blocking=True)
                made = False
            if g.graph is not None:  # (a graph just captured has computed nothing yet)
                g.graph.replay()
            elif not made:  # the stand-in: the same function over the same buffers, eagerly
                g.outputs = g.fn(*g.inputs)
            return [_out(o, a, rows, h) for o, a, h in zip(g.outputs, out_axes, to_host)]

    def _make(self, key: tuple, fn: GraphFn, feeds: Sequence[Feed], rows: int) -> Graph | None:
        """The key's static buffers (from these feeds, rows grown to its bucket) and its graph; None where the
        capture failed (the key then runs eagerly, and :attr:`eager` says why). The function runs eagerly over
        the buffers first: an error there is the call's own (bad input), raised to the caller, nothing kept."""
        bucket_rows = _bucket_of(key)
        start = time.perf_counter()
        inputs = [_grown(f.tensor.to(self.device), f.axis, bucket_rows) for f in feeds]
        outputs, graph = fn(*inputs), None
        if self.capture:
            try:
                graph, outputs = self._capture(fn, inputs)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run this key eagerly, and say so
                self.eager[key] = f"capture failed: {type(exc).__name__}: {exc}"
                log.warning("graph %s runs eagerly: %s", key, self.eager[key])
                return None
        self.capture_s += time.perf_counter() - start
        self.buffer_bytes += tensor_bytes(inputs)
        if graph is not None:
            self.pool_bytes = self._pool_bytes()
        if self.started:
            self.captured_after_start += 1
            log.warning("graph %s made by a call after the warm-up (that call was slow)", key)
        g = Graph(fn, inputs, [f.axis for f in feeds], outputs, graph)
        self.graphs[key] = g
        return g

    def _capture(self, fn: GraphFn, inputs: list[torch.Tensor]):
        """Capture ``fn(*inputs)`` into the shared pool after two more eager runs on a side stream (lazy
        initialisation, such as cuBLAS's workspaces, must not happen inside a capture); see :func:`_capturing`."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with _on_stream(side, self.device):
            for _ in range(2):
                fn(*inputs)
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with _capturing(graph, self._capture_stream, self.device, self.pool):
            outputs = fn(*inputs)
        return graph, outputs

    def describe(self) -> dict:
        return {"graphs": len(self.graphs), "capture_s": round(self.capture_s, 3),
                "graph_memory_mb": round(self.memory_mb(), 1), "captured": self.capture,
                "captured_after_start": self.captured_after_start}


def _bucket_of(key: tuple) -> int:
    """A key's row bucket: its last element (the convention of every key this module is given)."""
    assert isinstance(key[-1], int), key
    return key[-1]


def _out(x: torch.Tensor, axis: int, rows: int, host: bool) -> torch.Tensor:
    part = x.narrow(axis, 0, rows)
    if host:
        return part.cpu() if part.device.type != "cpu" else part.clone()
    return part.clone()
