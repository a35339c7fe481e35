"""The verifier's settings (environment ``SPECREC_VERIFIER_*``; documented by ``scripts/settings_doc.py``), and the
keyword arguments of the backend they choose (:func:`backend_options`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from specrec_rpc.settings import ServiceSettings


class VerifierSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECREC_VERIFIER_", extra="ignore")

    port: int = Field(50053, ge=0, le=65535, description="gRPC port")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus port (0 = off)")
    bundle: Path = Field(Path("bundles/beauty-loo"), description="trained bundle directory")
    backend: Literal["onnx", "eager", "cuda"] = Field(
        "onnx", description="hot-path backend: ONNX Runtime (its CUDA provider when onnxruntime-gpu is installed, "
        "else the CPU), eager PyTorch on `device` (the reference), or cuda: the registry's searches captured as CUDA "
        "graphs on `device` (a GPU)")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where the eager and cuda backends "
                        "compute: cpu, cuda or cuda:N (onnx ignores it: ONNX Runtime takes its CUDA provider when it "
                        "has one)")
    cuda_graph_batch_sizes: list[int] = Field(
        [1, 2, 4, 8, 16, 32, 64], min_length=1, description="the cuda backend's batch-size buckets, one graph per "
        "search, width and bucket captured at start (a batch is padded up to the next bucket)")
    onnx_dir: Path | None = Field(None, description="exported ONNX graphs (default: the bundle's onnx/ when "
                                  "`specrec export-onnx` built it for these weights, else exported once per weights "
                                  "under $SPECREC_CACHE/onnx)")
    itemset_addr: str = Field("127.0.0.1:50051", description="item-set service address")
    threads: int = Field(1, ge=1, le=256, description="intra-op threads of the backend (measured best at batch 1 on "
                         "2 cores: 1, leaving a core to gRPC and Python)")
    compute_threads: int = Field(1, ge=1, le=64, description="batches computed at once (each on its own thread, "
                                 "threads intra-op threads each); a job that arrives while every thread computes waits "
                                 "and is batched with the others")
    compute_on_loop: bool | None = Field(
        None, description="compute the batches on the event loop's own thread instead of a compute thread (no "
        "hand-off between threads: ~0.25 ms of CPU a call less on 2 cores; nothing else runs while a batch computes, "
        "and no hang_s watchdog: for a CPU, whose compute does not hang as a lost GPU's does). Unset: on the loop "
        "when the backend computes on the CPU with one compute thread and no hang is injected (fault_hang_after), "
        "and is not the cuda backend (its captured graphs serve buckets of batched rows, which form while a batch "
        "computes: it batches on a compute thread on any device)")
    max_batch: int = Field(64, ge=1, le=4096, description="most jobs computed in one batch")
    session_ttl_s: float = Field(
        30.0, gt=0, le=3600, description="an idle session is forgotten after this many seconds"
    )
    max_sessions: int = Field(
        20_000, ge=1, le=10_000_000, description="at most this many sessions (oldest evicted first)"
    )
    max_width: int = Field(1000, ge=1, le=10_000, description="largest beam width accepted")
    max_candidates: int = Field(
        4096, ge=1, le=100_000, description="largest number of candidates per session row in one Score"
    )
    require_gpu: bool = Field(
        False,
        description="fail at start unless the model computes on a GPU: the cuda or eager backend on a CUDA device, "
        "or ONNX Runtime on its CUDA execution provider (a GPU verifier that silently fell back to the CPU would miss "
        "every budget)",
    )
    hang_s: float = Field(10.0, ge=0.0, le=3600, description="watchdog: a batch computing longer than this is a hung "
                          "device, and the verifier leaves rotation for good (health NOT_SERVING, calls UNAVAILABLE "
                          "with reason DEVICE_FAILED), as after a CUDA error; 0 = off")
    fault_delay_ms: float = Field(0.0, ge=0.0, le=60_000, description="fault injection (chaos runs and tests): every "
                                  "call waits this long before its job is queued; 0 = off")
    fault_device_error_after: int = Field(0, ge=0, description="fault injection (tests, drills): after this many "
                                          "batches computed while serving, every batch fails with a CUDA error as a "
                                          "failed GPU's do; 0 = off")
    fault_hang_after: int = Field(0, ge=0, description="fault injection (tests, drills): after this many batches "
                                  "computed while serving, the next one hangs (until the service stops); 0 = off")
    warmup_k: list[int] = Field([10, 50], description="list lengths K whose graphs (beam search of width K, the head's "
                                "searches of every draft count) are ready before SERVING")

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _buckets(cls, v: list[int]) -> list[int]:
        if min(v) < 1:
            raise ValueError("batch sizes must be at least 1")
        return sorted(set(v))


def backend_options(s: VerifierSettings) -> dict:
    """The keyword arguments :meth:`specrec.bundle.Bundle.backend` builds ``s.backend`` with."""
    if s.backend == "onnx":
        return {"threads": s.threads, "onnx_dir": s.onnx_dir}
    if s.backend == "cuda":
        return {"device": s.device, "batch_sizes": tuple(s.cuda_graph_batch_sizes)}
    return {"device": s.device}


def computes_on_loop(s: VerifierSettings, backend) -> bool:
    """Whether the batches compute on the event loop's thread (``compute_on_loop``, or by default where nothing
    needs them off it: a CPU backend, one compute thread, no hang injected; never the cuda backend, whose graphs
    replay buckets of rows batched while another batch computes, on whatever device it is given)."""
    if s.compute_on_loop is not None:
        return s.compute_on_loop
    return (s.compute_threads == 1 and not s.fault_hang_after and not on_gpu(backend)
            and backend.describe().get("backend") != "cuda")


def on_gpu(backend) -> bool:
    """Whether ``backend`` computes on a GPU: a CUDA device (the eager and cuda backends), or ONNX Runtime's CUDA
    execution provider."""
    return (str(backend.describe().get("device", "cpu")).startswith("cuda")
            or "CUDAExecutionProvider" in getattr(backend, "providers", []))
