"""Where training runs, and how a batch size moves to another device.

Every training stage (the GR model, SASRec, the drafters and their distillation) takes a ``device``: ``cpu``
(the default, and every CPU figure as before) or ``cuda`` (``cuda:N``). On a GPU the model, its frozen teacher
and the training data live on the device (copied there once, so a step moves only its batch's row indices;
what is streamed per batch goes through pinned memory with ``non_blocking`` copies), matmuls run in bfloat16
under ``torch.autocast(device.type)`` where the stage asks for it, and validation's passes run there too.

A GPU wants bigger batches than two CPU cores. ``batch_scale`` k multiplies a recipe's batch size by k and
scales the rest with it (:func:`scale_batch`):

- the learning rate by sqrt(k): the square-root rule for Adam-type optimisers (Malladi et al., NeurIPS 2022,
  "On the SDEs and scaling rules for adaptive gradient algorithms"; Hoffer et al. 2017), which keeps the
  update's noise scale; the linear rule (Goyal et al. 2017) is SGD's and overshoots AdamW at large k;
- warm-up steps by 1/k, so warm-up spans the same number of examples;
- epochs unchanged: the same sample budget.

The rule is a starting point: the values a GPU run serves are chosen on validation users there. The run
records the device and the batch it used (``TrainConfig.device`` / ``batch_size`` / ``batch_scale``, and each
epoch's ``device`` in ``train_log.jsonl``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

DEVICES = ("cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` -> the device, or a clear error where it is not there."""
    dev = torch.device(name)
    if dev.type not in DEVICES:
        raise ValueError(f"device {str(name)!r}: training runs on {' or '.join(DEVICES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {str(name)!r}: torch finds no CUDA device here (torch {torch.__version__}, "
                             f"{build}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(name)!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def autocast(device: torch.device, enabled: bool):
    """bfloat16 autocast for ``device``'s kind (weights stay float32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def to_device(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device``: as it is on the CPU; through pinned memory, without waiting, on a
    GPU (the copy overlaps the work already queued)."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def scale_batch(batch_size: int, lr: float, k: float, warmup_steps: int | None = None) -> tuple[int, float, int | None]:
    """(batch size, learning rate, warm-up steps) for ``k`` times the batch: the square-root rule (module
    docstring). k = 1 returns them unchanged."""
    if k <= 0:
        raise ValueError(f"batch scale {k}: must be > 0")
    if k == 1:
        return batch_size, lr, warmup_steps
    batch = max(1, round(batch_size * k))
    real = batch / batch_size  # the ratio the rounding left
    warm = None if warmup_steps is None else math.ceil(warmup_steps / real)
    return batch, lr * math.sqrt(real), warm


def cpu_copy(obj: Any) -> Any:
    """``obj`` (a state dict, an optimizer's, nested dicts and lists) with every tensor on the CPU: what a
    checkpoint saves, so that it loads on any machine."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The random generators a training step draws from (dropout): the CPU's, and the GPU's on a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> bool:
    """Restore :func:`rng_state`'s generators -> whether the device's own stream went on (False when the run
    moved between a CPU and a GPU: dropout then draws a new stream, seeded from the saved CPU one)."""
    torch.set_rng_state(state["cpu"])
    if device.type != "cuda":
        return "cuda" not in state
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
        return True
    torch.cuda.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    return False


@contextmanager
def on_device(module: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """``module`` on ``device`` for the block, back where it was after (a frozen teacher the caller owns)."""
    home = next(module.parameters()).device
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)
