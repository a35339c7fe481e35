"""A device that fails: which errors take a verifier out (:func:`specrec.verifier.device_failure`), and the
batcher that ends on one, or on a batch that hangs past its watchdog (``hang_s``); what must never take it out (a
bad request, an out-of-memory batch, a bug that names no device)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specrec.verifier import DeviceFailure, device_failure
from specrec.verifier.jobs import EncodeJob
from specrec_rpc.errors import InvalidArgument
from verifier_svc.batcher import Batcher
from verifier_svc.settings import VerifierSettings, backend_options, computes_on_loop, on_gpu

from .policy_fixtures import histories, make_engine

FAILED = [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call"),
    RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA driver error: device not ready"),
    RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, ...)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    # ONNX Runtime's CUDA provider (its own exception types: matched by the CUDA runtime's wording)
    Exception("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was encountered ; GPU=0"),
    RuntimeError("NVML: GPU is lost, reboot the system to recover"),
    RuntimeError("lost device 0 while computing"),
    DeviceFailure("hang", "a batch has computed for 12.0 s"),
]
FINE = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 139 GiB total capacity)"),
    torch.AcceleratorError("CUDA error: out of memory"),
    RuntimeError("CUDA error: invalid argument"),
    RuntimeError("CUDA error: invalid configuration argument"),
    RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx(...)`"),
    RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    InvalidArgument("ref.history_sids", "code out of range at index [0, 2, 1]"),  # a bad request
    ValueError("CUDA error: device-side assert triggered"),  # the core's and the services' bad input: ValueErrors
    RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"),
    IndexError("index out of range in self"),
    RuntimeError("The size of tensor a (20) must match the size of tensor b (16) at non-singleton dimension 1"),
    KeyError("search"),
    # a graph capture in another thread refused this call, or was invalidated by it: no CUDA context is broken
    # (a replica once took itself out for good on the first of these)
    torch.AcceleratorError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors "
                           "might be asynchronously reported at some other API call"),
    RuntimeError("CUDA error: operation failed due to a previous error during capture"),
    RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking stream"),
    RuntimeError("CUDA error: dependency created on uncaptured work in another stream"),
]


@pytest.mark.parametrize("exc", FAILED, ids=lambda e: str(e)[:40])
def test_cuda_errors_and_lost_devices_are_device_failures(exc):
    failure = device_failure(exc)
    assert isinstance(failure, DeviceFailure)
    assert failure.kind == ("hang" if isinstance(exc, DeviceFailure) else "error")
    first = str(exc).splitlines()[0]
    assert first[:30] in str(failure), failure


@pytest.mark.parametrize("exc", FINE, ids=lambda e: f"{type(e).__name__}: {str(e)[:40]}")
def test_bad_requests_oom_and_bugs_are_not(exc):
    assert device_failure(exc) is None


def test_a_device_failure_wrapped_by_another_error_is_found():
    try:
        try:
            raise torch.AcceleratorError("CUDA error: misaligned address")
        except RuntimeError as inner:
            raise RuntimeError("beam search failed") from inner
    except RuntimeError as outer:
        failure = device_failure(outer)
    assert failure is not None and "misaligned address" in failure.detail


def run(coro):
    return asyncio.run(coro)


def _batcher(run_batch, failures: list, hang_s: float = 0.0, concurrency: int = 1) -> Batcher:
    return Batcher("t", run_batch, ThreadPoolExecutor(concurrency), concurrency=concurrency, hang_s=hang_s,
                   on_failure=failures.append)


@pytest.mark.parametrize("as_result", [True, False], ids=["a job's result", "the whole batch raised"])
def test_a_device_error_fails_the_batch_what_queued_and_every_later_job(as_result):
    gate, failures, computed = threading.Event(), [], []
    cuda = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    def run_batch(jobs):
        computed.append(list(jobs))
        gate.wait(5)
        if "boom" in jobs:
            if not as_result:
                raise cuda
            return [cuda if j == "boom" else j.upper() for j in jobs]  # one job failed, its batch-mates did not
        return [j.upper() for j in jobs]

    async def scenario():
        b = _batcher(run_batch, failures)
        b.start()
        gate.set()
        assert await b.submit("a", None) == "A"
        gate.clear()
        first = asyncio.ensure_future(b.submit("boom", None))
        await asyncio.sleep(0.05)  # "boom" computes; "c" and "d" queue behind it
        queued = [asyncio.ensure_future(b.submit(j, None)) for j in ("c", "d")]
        await asyncio.sleep(0.05)
        gate.set()
        got = await asyncio.gather(first, *queued, return_exceptions=True)
        with pytest.raises(DeviceFailure):
            await b.submit("later", None)
        await b.stop()
        return b, got

    b, got = run(scenario())
    assert all(isinstance(r, DeviceFailure) and r.kind == "error" for r in got), got
    assert len(failures) == 1 and failures[0] is b.failed and "illegal memory access" in str(b.failed)
    assert computed == [["a"], ["boom"]]  # nothing computed after the failure


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"),
                                 InvalidArgument("sids", "code out of range")], ids=["oom", "bad request"])
def test_an_error_that_is_not_the_devices_fails_its_job_alone(exc):
    failures = []

    def run_batch(jobs):
        return [exc if j == "bad" else j.upper() for j in jobs]

    async def go():
        b = _batcher(run_batch, failures)
        b.start()
        with pytest.raises(type(exc)):
            await b.submit("bad", None)
        out = await b.submit("good", None)
        await b.stop()
        return b, out

    b, out = run(go())
    assert out == "GOOD" and b.failed is None and not failures


def test_a_batch_past_the_watchdog_is_a_hung_device():
    release, failures = threading.Event(), []

    def run_batch(jobs):
        if "stuck" in jobs:
            release.wait(10)  # a kernel that never returns (until the test lets it go)
        return list(jobs)

    async def go():
        b = _batcher(run_batch, failures, hang_s=0.2)
        b.start()
        assert await b.submit("quick", None) == "quick"
        t0 = time.monotonic()
        stuck = asyncio.ensure_future(b.submit("stuck", None))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(b.submit("queued", None))
        got = await asyncio.gather(stuck, queued, return_exceptions=True)
        waited = time.monotonic() - t0
        with pytest.raises(DeviceFailure):
            await b.submit("later", None)
        release.set()
        await b.stop()
        return b, got, waited

    b, got, waited = run(go())
    assert all(isinstance(r, DeviceFailure) and r.kind == "hang" for r in got), got
    assert 0.2 <= waited < 5.0, waited  # failed by the watchdog, not by the stuck thread letting go
    assert failures == [b.failed] and "0.2 s watchdog" in str(b.failed)


def test_without_a_watchdog_a_long_batch_is_only_long():
    failures = []

    def run_batch(jobs):
        time.sleep(0.3)
        return list(jobs)

    async def go():
        b = _batcher(run_batch, failures, hang_s=0.0)
        b.start()
        out = await b.submit("slow", None)
        await b.stop()
        return b, out

    b, out = run(go())
    assert out == "slow" and b.failed is None and not failures


def test_the_runner_hands_a_backends_cuda_error_to_the_batcher_which_ends_on_it(monkeypatch):
    """The path the service runs: the backend raises inside the runner (its group's jobs get the error as their
    result), and the batcher reads it as a failed device."""
    eng = make_engine(5)
    failures = []
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(eng.verifier.backend, "_encode", broken)
    h = eng.history_sids(histories(eng, 1, 0)).numpy()

    async def go():
        b = _batcher(lambda jobs: eng.verifier.runner.run(jobs), failures)
        b.start()
        with pytest.raises(DeviceFailure) as e:
            await b.submit(EncodeJob(h), None)
        await b.stop()
        return e.value

    failure = run(go())
    assert calls and failure.kind == "error" and failures == [failure]


def test_settings_choose_the_gpu_backends_options():
    cuda = VerifierSettings(backend="cuda", device="cuda", cuda_graph_batch_sizes=[8, 1, 2, 2, 4])
    assert backend_options(cuda) == {"device": "cuda", "batch_sizes": (1, 2, 4, 8)}
    assert backend_options(VerifierSettings(backend="eager", device="cuda:1")) == {"device": "cuda:1"}
    assert set(backend_options(VerifierSettings())) == {"threads", "onnx_dir"}
    assert VerifierSettings().cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    for bad in ({"device": "gpu"}, {"device": "cuda:x"}, {"cuda_graph_batch_sizes": [0, 1]},
                {"cuda_graph_batch_sizes": []}, {"backend": "torch"}, {"hang_s": -1}):
        with pytest.raises(ValueError):
            VerifierSettings(**bad)


class _Described:
    def __init__(self, **d):
        self.d = d
        self.providers = d.pop("providers", [])

    def describe(self):
        return self.d


def test_require_gpu_accepts_a_cuda_device_or_onnx_runtimes_cuda_provider():
    assert on_gpu(_Described(backend="cuda", device="cuda:0"))
    assert on_gpu(_Described(backend="eager", device="cuda:1"))
    assert on_gpu(_Described(backend="onnx", providers=["CUDAExecutionProvider", "CPUExecutionProvider"]))
    assert not on_gpu(_Described(backend="onnx", providers=["CPUExecutionProvider"]))
    assert not on_gpu(make_engine(0).verifier.backend)  # the eager backend on the CPU


def test_batches_compute_on_the_loop_only_where_nothing_needs_them_off_it():
    s, cpu = VerifierSettings(), _Described(backend="onnx", device="cpu", providers=["CPUExecutionProvider"])
    assert computes_on_loop(s, cpu)
    assert not computes_on_loop(s.model_copy(update={"compute_threads": 2}), cpu)
    assert not computes_on_loop(s.model_copy(update={"fault_hang_after": 3}), cpu)
    assert not computes_on_loop(s, _Described(backend="onnx", providers=["CUDAExecutionProvider"]))
    # the cuda backend batches rows into its graphs' buckets while a batch computes, on any device
    assert not computes_on_loop(s, _Described(backend="cuda", device="cpu"))
    assert not computes_on_loop(s.model_copy(update={"compute_on_loop": False}), cpu)
    assert computes_on_loop(s.model_copy(update={"compute_on_loop": True}), _Described(backend="cuda", device="cpu"))
