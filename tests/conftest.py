import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings

# CI (SPECREC_CI=1) draws the same property-test examples on every clean clone, so a verdict does not depend
# on a fresh random draw; a local run explores new ones
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("SPECREC_CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # the repository's datasets (data/README.md)

torch.set_num_threads(int(os.environ.get("SPECREC_THREADS", max(1, min(2, os.cpu_count() or 1)))))


def beauty_dir() -> Path:
    return DATA / "beauty"


@pytest.fixture(scope="session")
def synth():
    from specrec.data import synthetic_dataset

    return synthetic_dataset(n_items=300, n_users=400, seed=1)


def clustered_embeddings(n: int, d: int = 32, clusters: int = 12, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    x = centres[rng.integers(0, clusters, n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def tiny_config(**kw):
    from specrec.models.tiger import TigerConfig

    base = dict(level_sizes=[6, 5, 4, 3], d_model=32, n_heads=2, d_kv=16, d_ff=64,
                n_enc_layers=2, n_dec_layers=2, max_history=6, dropout=0.0)
    base.update(kw)
    return TigerConfig(**base)


def random_sids(n: int, level_sizes, seed: int = 0) -> np.ndarray:
    """n distinct SIDs drawn uniformly from the full code space."""
    rng = np.random.default_rng(seed)
    space = int(np.prod(level_sizes))
    flat = rng.choice(space, size=n, replace=False)
    out = np.zeros((n, len(level_sizes)), dtype=np.int64)
    for lvl in range(len(level_sizes) - 1, -1, -1):
        out[:, lvl] = flat % level_sizes[lvl]
        flat //= level_sizes[lvl]
    return out


def tiny_tiger(seed: int = 11):
    """A tiny sharpened TIGER model (history window 8), its NEZHA head and 50 random item SIDs, seeded: what the
    backend tests export to graphs and compare with eager."""
    from specrec.models.nezha_head import NezhaHead
    from specrec.models.tiger import Tiger

    torch.manual_seed(seed)
    m = Tiger(tiny_config(max_history=8)).eval()
    sharpen(m, 20)
    return m, NezhaHead(m).eval(), random_sids(50, m.cfg.level_sizes, seed)


def sharpen(model, factor: float) -> None:
    """Make a random model's output distributions decisive (tests want clear rankings)."""
    import torch

    with torch.no_grad():
        if model.heads is not None:
            for h in model.heads:
                h.weight.mul_(factor)
        else:
            model.tok.weight.mul_(factor ** 0.5)
            for b in model.head_bias:
                b.normal_(0, 1.0)
