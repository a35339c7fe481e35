"""Opening a dataset by name: a directory in the dataset format, or the synthetic catalogue."""

from __future__ import annotations

from pathlib import Path

from .dataset import Dataset, load_dataset
from .synthetic import synthetic_dataset


def open_dataset(data: str | Path | None, synthetic_seed: int = 0) -> Dataset:
    """A dataset directory, or the synthetic catalogue when ``data`` is None or 'synthetic'."""
    if data is None or str(data) == "synthetic":
        return synthetic_dataset(seed=synthetic_seed)
    return load_dataset(data)
