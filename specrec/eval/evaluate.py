"""Offline evaluation: Recall/NDCG@K and per-request latency.

A *ranker* maps a batch of item-index histories to ranked item lists
``[R, K]`` (-1 for empty slots). Latency is wall time per ranker call divided
by the requests in it; with ``batch_size=1`` (the default) it is the honest
per-request latency of a batch-1 server.

Under the temporal protocol figures are also given for test targets that are
in-sample (seen in training) and unseen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data.splits import Examples, Split
from ..terminal import progress_bar
from .metrics import metrics_from_ranks, percentiles_ms, target_ranks

Ranker = Callable[..., np.ndarray]  # (histories, k[, exclude]) -> [R, k] items


@dataclass
class EvalResult:
    name: str
    n: int
    overall: dict[str, float]
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        out = {f"{k}": v for k, v in self.overall.items()}
        for g, m in self.groups.items():
            out.update({f"{g}_{k}": v for k, v in m.items()})
        out.update(self.latency)
        out.update({k: v for k, v in self.extra.items() if isinstance(v, (int, float))})
        return out

    def as_dict(self) -> dict:
        return {"name": self.name, "n": self.n, "overall": self.overall, "groups": self.groups,
                "latency": self.latency, **self.extra}


def run_ranker(
    ranker: Ranker, ex: Examples, k: int, batch_size: int = 1, progress: bool = True, desc: str = "eval",
    exclude: list[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Ranked lists [N, k] and per-request seconds [N]. With ``exclude`` (per example, the items it must
    not get back: its whole history) the ranker is called as ``ranker(histories, k, exclude)``."""
    hists = ex.histories()
    ranked = np.full((len(ex), k), -1, dtype=np.int64)
    secs = np.zeros(len(ex))
    for s in progress_bar(range(0, len(ex), batch_size), desc=desc, disable=not progress, leave=False,
                          total=(len(ex) + batch_size - 1) // batch_size):
        batch = hists[s : s + batch_size]
        t0 = time.perf_counter()
        out = ranker(batch, k) if exclude is None else ranker(batch, k, exclude[s : s + batch_size])
        dt = time.perf_counter() - t0
        out = np.asarray(out)[:, :k]
        ranked[s : s + len(batch), : out.shape[1]] = out
        secs[s : s + len(batch)] = dt / len(batch)
    return ranked, secs


def summarise(name: str, ranked: np.ndarray, secs: np.ndarray, ex: Examples, split: Split,
              ks: Sequence[int] = (5, 10, 50)) -> EvalResult:
    ranks = target_ranks(ranked, ex.target)
    res = EvalResult(name, len(ex), metrics_from_ranks(ranks, ks), latency=percentiles_ms(secs))
    if split.protocol == "temporal":
        unseen = ~split.seen[ex.target]
        res.groups["in_sample"] = metrics_from_ranks(ranks[~unseen], ks)
        res.groups["unseen"] = metrics_from_ranks(ranks[unseen], ks)
        res.extra["n_unseen"] = int(unseen.sum())
    return res


def compare(
    rankers: dict[str, Ranker], ex: Examples, k: int, progress: bool = True, warmup: int = 5,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Run several rankers on the same requests, one request at a time and
    interleaved (request 1 through every ranker, then request 2, ...), so
    they are timed under the same conditions. A few warm-up requests per
    ranker are run first and not timed."""
    hists = ex.histories()
    for rank in rankers.values():
        for h in hists[:warmup]:
            rank([h], k)
    out = {name: (np.full((len(ex), k), -1, dtype=np.int64), np.zeros(len(ex))) for name in rankers}
    for i in progress_bar(range(len(ex)), desc="requests", disable=not progress, leave=False):
        for name, rank in rankers.items():
            t0 = time.perf_counter()
            lst = np.asarray(rank([hists[i]], k))[0][:k]
            out[name][1][i] = time.perf_counter() - t0
            out[name][0][i, : len(lst)] = lst
    return out


def beam_ranker(bundle, width: int, backend=None) -> Ranker:
    """The baseline: trie-constrained beam search with a KV cache."""
    from ..decoding.beam import beam_search

    backend = backend or bundle.backend()

    @torch.inference_mode()
    def rank(histories: list[np.ndarray], k: int, exclude: list[np.ndarray] | None = None) -> np.ndarray:
        trie = bundle.trie
        enc = backend.encode(bundle.history_sids(histories))
        if exclude is None:
            return beam_search(backend, enc, trie, max(width, k)).items(trie)[:, :k].numpy()
        # each request has its own valid set (the trie without its history): one search per request
        out = []
        for j, items in enumerate(exclude):
            view = trie.excluding(bundle.sids[np.unique(np.asarray(items, dtype=np.int64))])
            out.append(beam_search(backend, enc.select(torch.tensor([j])), view, max(width, k)).items(view)[:, :k])
        return torch.cat(out).numpy()

    return rank


def sasrec_ranker(bundle) -> Ranker:
    """The SASRec baseline of a bundle (``specrec train-baseline``), ranked by the drafter that serves it
    (:meth:`Bundle.drafter` ``sasrec``, what the ``drafter`` policy answers with): its top K of the items it was
    trained on, with the bundle's unseen share drafted by text."""
    if bundle.sasrec is None:
        raise ValueError(f"bundle {bundle.name!r} has no SASRec baseline (run `specrec train-baseline`)")
    return drafter_ranker(bundle.drafter("sasrec"))


def drafter_ranker(drafter) -> Ranker:
    """An item drafter's own list of K (an n = K draft, as the ``drafter`` policy asks for) as a ranker."""
    from ..drafters.base import DraftRequest

    def rank(histories: list[np.ndarray], k: int, exclude: list[np.ndarray] | None = None) -> np.ndarray:
        ban = [frozenset()] * len(histories) if exclude is None else [
            frozenset(np.asarray(e, dtype=np.int64).tolist()) for e in exclude]
        drafts = drafter.draft([DraftRequest(np.asarray(h, dtype=np.int64), k, None, b)
                                for h, b in zip(histories, ban)])
        out = np.full((len(histories), k), -1, dtype=np.int64)
        for i, d in enumerate(drafts):
            out[i, : min(k, len(d.items))] = d.items[:k]
        return out

    return rank
