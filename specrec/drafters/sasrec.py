"""SASRec drafter: the bundle's SASRec (``specrec train-baseline``), the strongest item model we have, as an
item drafter.

A history's last state scores every item SASRec was trained on (inner product with its item embedding); the
scores are SASRec's log-softmax over that catalogue, the distribution it was trained to give, so a fused
ranking (:mod:`specrec.fusion`) reads them as log-probabilities. Drafts are the top ``n`` of the items it can
score that are active and were seen in training; with ``prefixes`` (guided re-drafting) only items under
them, on the same scale.

SASRec has no embedding worth the name for an item no one interacted with (new items, or items first seen
after a temporal cut-off), so ``unseen_share`` of the drafts comes from the text-aware retrieval drafter
(``unseen_source``: the unseen items whose text is most like the history's recent items), as the retrieval
drafter does for itself; their scores sit below every SASRec score (they are not on its scale).

The matrix product over the catalogue is exact (a 64-dimensional state against 12k items is ~1.6 MFLOP); a
catalogue of millions would want an index, and the log-softmax's normaliser a bound instead.

The history's state, the product and the log-softmax run as one ONNX Runtime graph (``backend="onnx"``, the
default; exported from the model on first use and checked against it, one thread): eager PyTorch spends most of
a draft in the two transformer layers' Python (measured, one thread, 300 Beauty test users side by side:
1.45 ms p50 / 4.6 ms p99 eager, 0.6 / 1.1-1.6 ms in the graph, the same log-probabilities to 1e-5).
``backend="eager"``, or a graph that cannot be built or disagrees, runs the model itself.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..backends.onnx import session_options
from ..data.histories import left_pad
from ..fusion import Fusion
from ..itemset import LocalItemSet
from ..models.sasrec import SASRec
from .base import Draft, DraftRequest, topn_excluding


class _LastLogSoftmax(nn.Module):
    """items [R, H] (left-padded with -1) -> SASRec's log-probabilities [R, n_known] after the last one."""

    def __init__(self, model: SASRec, emb: torch.Tensor):
        super().__init__()
        self.model, self.emb = model, emb

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model.sequence(items)[:, -1] @ self.emb.T, -1)


def _graph(model: SASRec, emb: torch.Tensor):
    """An ONNX Runtime session of :class:`_LastLogSoftmax` (batch dynamic, one thread), checked against the model
    on a few histories; None where onnxruntime is missing, the export fails or the graph disagrees."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a dependency of the package
        return None
    h = model.cfg.max_history
    net = _LastLogSoftmax(model, emb).eval()  # export restores the wrapper's mode: it must be eval's too
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, len(emb), (3, h), generator=gen)
    probe[0, : h - 1], probe[1, : h // 2] = -1, -1  # one item, half a window, a full one
    buf = io.BytesIO()
    fast = torch.backends.mha.get_fastpath_enabled()
    try:
        torch.backends.mha.set_fastpath_enabled(False)  # the fused encoder kernel has no ONNX export
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on constant shapes: the check below is the test
            # the TorchScript exporter writes to a buffer too (its stub says a path only)
            torch.onnx.export(net, (probe,), buf, input_names=["items"],  # type: ignore[arg-type]
                              output_names=["logp"], dynamic_axes={"items": {0: "R"}, "logp": {0: "R"}},
                              opset_version=17, dynamo=False)
        sess = ort.InferenceSession(buf.getvalue(), session_options(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any exporter or runtime failure: the model itself runs
        return None
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    with torch.inference_mode():
        want = net(probe).numpy()
    got = sess.run(None, {"items": probe.numpy()})[0]
    return sess if np.allclose(got, want, atol=1e-4, rtol=0.0) else None


class SasrecDrafter:
    name = "sasrec"

    def __init__(self, model: SASRec, itemset: LocalItemSet, unseen_source=None, unseen_share: float = 0.0,
                 fusion: Fusion | None = None, backend: str = "onnx"):
        """``unseen_source``: a :class:`~specrec.drafters.retrieval.RetrievalDrafter` drafting the unseen share
        (None: no unseen items are drafted); ``fusion``: how a policy ranking by both models weighs these scores
        (the bundle's, chosen on validation users), told to whoever drafts with it; ``backend``: "onnx" (its graph,
        built on first use) or "eager"."""
        if not 0.0 <= unseen_share <= 1.0:
            raise ValueError(f"unseen_share {unseen_share}: must be in [0, 1]")
        if backend not in ("onnx", "eager"):
            raise ValueError(f"backend {backend!r}: expected 'onnx' or 'eager'")
        self.backend = backend
        self._session: Any = None  # the graph, once built (backend "onnx")
        self.model = model.eval()
        # [n_known, d]: the rows it was trained on. Its products stay in torch: a numpy product here runs on
        # OpenBLAS's threads, which spin against torch's OpenMP workers (measured: 1.1 ms a draft with one torch
        # thread, 8 ms p50 and 108 ms p99 with two)
        self.emb = model.item.weight[1:].detach().float().clone()
        self.unseen_source = unseen_source
        self.unseen_share = float(unseen_share) if unseen_source is not None else 0.0
        self.fusion = fusion
        self.set_itemset(itemset)

    @property
    def n_known(self) -> int:
        return len(self.emb)

    @property
    def vectors(self) -> torch.Tensor:
        """The item vectors it scores, one per row it was trained on (as the index-based drafters expose theirs)."""
        return self.emb

    def set_itemset(self, itemset: LocalItemSet) -> None:
        """Follow a catalogue version: rows added since training have no embedding and are not drafted."""
        rows = np.arange(min(self.n_known, itemset.n_rows))
        self.itemset = itemset
        self.eligible = rows[itemset.active[rows] & itemset.seen[rows]]

    def add_items(self, itemset: LocalItemSet, new_text_emb: np.ndarray | None = None) -> None:
        """Follow a catalogue version with rows appended; with their text embeddings, the unseen source indexes
        them too (in-process; a service's shared retrieval drafter follows the catalogue on its own)."""
        if new_text_emb is not None and self.unseen_source is not None:
            self.unseen_source.add_items(itemset, new_text_emb)
        self.set_itemset(itemset)

    def warmup(self) -> str:
        """Build the graph now (a service before it serves; else the first draft does): the backend that runs."""
        if self.backend == "onnx" and self._session is None:
            self._session = _graph(self.model, self.emb)
            if self._session is None:
                self.backend = "eager"
        return self.backend

    def log_softmax(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        """SASRec's log-probability of every item it knows after each history: [R, n_known]."""
        x = left_pad(histories, self.model.cfg.max_history, known=self.n_known)
        if self.warmup() == "onnx":
            return self._session.run(None, {"items": x})[0]
        with torch.inference_mode():
            return torch.log_softmax(self.model.sequence(torch.from_numpy(x))[:, -1] @ self.emb.T, -1).numpy()

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        logp = self.log_softmax([r.history for r in requests])
        model = []
        for i, r in enumerate(requests):
            rows = self.eligible
            if r.prefixes is not None:
                rows = np.intersect1d(rows, self.itemset.items_with_prefixes(r.prefixes), assume_unique=True)
            model.append(topn_excluding(logp[i, rows], rows, r.n, r.exclude))  # n: the unseen part may fall short
        if self.unseen_source is None:
            return model
        # the unseen share, and whatever SASRec's list lacks (few known items under a re-draft's prefixes, or
        # only new ones there): the text-aware source drafts unseen items for those places
        n_new = [min(r.n, max(int(round(r.n * self.unseen_share)), r.n - len(d.items)))
                 for r, d in zip(requests, model)]
        if not any(n_new):
            return model
        taken = [frozenset(r.exclude) | frozenset(d.items[: r.n - k].tolist())
                 for r, d, k in zip(requests, model, n_new)]
        unseen = self.unseen_source.unseen_drafts(requests, n_new, taken)
        out = []
        for r, d, u in zip(requests, model, unseen):
            lead = min(r.n - len(u.items), len(d.items))  # what the unseen part did not take goes back to SASRec
            low = float(d.scores[lead - 1]) if lead > 0 else 0.0
            # below every SASRec score of the list, in the text similarity's own order (cosine in [-1, 1])
            u_scores = low - 3.0 + u.scores.astype(np.float32)
            out.append(Draft(np.concatenate([d.items[:lead], u.items]).astype(np.int64),
                             np.concatenate([d.scores[:lead], u_scores]).astype(np.float32)))
        return out
