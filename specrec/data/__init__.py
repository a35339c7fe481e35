"""Data: the JSONL format, loaders, evaluation protocols and a synthetic catalogue."""

from .dataset import Catalogue, DataFormatError, Dataset, Sequence, load_dataset
from .splits import PAD, Examples, Split, leave_one_out, make_split, temporal
from .synthetic import synthetic_dataset

__all__ = [
    "Catalogue", "DataFormatError", "Dataset", "Sequence", "load_dataset",
    "PAD", "Examples", "Split", "leave_one_out", "make_split", "temporal", "synthetic_dataset",
]
