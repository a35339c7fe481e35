"""In-process recommendations from a bundle: no Redis, no gRPC.

:class:`Recommender` loads a trained bundle and answers the way the gateway
does, by the same code: the same policies (:mod:`specrec.policies`, ``auto`` by
default), the same :class:`~specrec.policies.Engine` over a
:class:`~specrec.verifier.LocalVerifier` (the bundle's hot-path backend, ONNX
Runtime by default), a :class:`~specrec.itemset.LocalItemSet` and the bundle's
drafter. Only the transport is missing, so the answer has the gRPC answer's
fields (``RecommendedItem`` / ``RecommendStats`` in
``protos/specrec/v1/recommender.proto``):

>>> from specrec import Recommender
>>> rec = Recommender.load("bundles/beauty-loo")
>>> answer = rec.recommend(["1258", "1259", "1260", "no-such-id"], k=5, policy="beam", budget_ms=None)
>>> len(answer.items), answer.stats.served_by, answer.stats.ignored_history
(5, 'beam', ['no-such-id'])
>>> top = answer.items[0]
>>> top.id in rec, len(top.sid), top.source, top.unseen
(True, 4, 'beam', False)

A new item is recommendable at once (no retraining: its semantic ID comes from
its text through the bundle's codebooks, and it is scored with the SpecGR L-1
rule, as an unseen item):

>>> new = rec.upsert({"item_id": "my-lipstick", "title": "Matte red lipstick, long lasting"})
>>> new.id, new.unseen, "my-lipstick" in rec, rec.itemset.version
('my-lipstick', True, True, '2')
>>> len(rec.recommend(["my-lipstick", "1258"], k=10).items)
10

Offline scoring of many histories, with a progress bar:

>>> answers = rec.recommend_batch([["1258", "1259"], ["1"], ["2", "3"]], k=10, policy="beam", budget_ms=None,
...                               progress=False)
>>> [len(a.items) for a in answers]
[10, 10, 10]

``budget_ms`` is the latency budget, as in the gateway (``None``: no budget);
``auto`` picks, per request, the most accurate policy whose learned cost fits
it. Policy parameters go as keyword arguments (``rec.recommend(h,
policy="specgr", gamma=-1.2)``); a bad one raises :class:`ValueError` naming
the field, as the gateway's INVALID_ARGUMENT does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class RecommendedItem:
    """One item of an answer (the gRPC ``RecommendedItem``)."""

    id: str
    sid: tuple[int, ...]  # its semantic ID, L codes
    score: float  # on the policy's scale; -inf for catalogue fill no model scored
    source: str  # draft, beam, head, sample or fill
    unseen: bool  # no training interactions (scored with the L-1 rule)
    title: str = ""


@dataclass
class RecommendStats:
    """How an answer was made (the gRPC ``RecommendStats``)."""

    policy: str  # the policy asked for
    served_by: str  # the policy that made the list (auto picks one)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifier_calls: int = 0
    encoder_calls: int = 0
    exit_reason: str = ""
    stage_ms: dict[str, float] = field(default_factory=dict)
    catalogue_version: str = ""
    degraded: bool = False
    degraded_reason: str = ""
    total_ms: float = 0.0
    ignored_history: list[str] = field(default_factory=list)  # history ids not in the catalogue (or deleted)


@dataclass
class Recommendation:
    """An answer: items best first, and its stats."""

    items: list[RecommendedItem]
    stats: RecommendStats

    @property
    def ids(self) -> list[str]:
        return [it.id for it in self.items]


class Recommender:
    """A bundle's recommender in this process (scikit-learn style: ``load``, then ``recommend``).

    Build one with :meth:`load`. It is not thread-safe: use one per thread, or
    the gRPC services for concurrent traffic.
    """

    def __init__(self, bundle, engine, drafter: str | None):
        self.bundle = bundle
        self.engine = engine
        self.drafter_kind = drafter
        cat = bundle.catalogue
        self._ids: list[str] = list(cat.ids)
        self._titles: list[str] = list(cat.titles)
        self._texts: list[str] = list(cat.texts)
        self._index: dict[str, int] = {i: r for r, i in enumerate(self._ids)}
        self._embedder: Callable[[list[str]], np.ndarray] | None = None

    @classmethod
    def load(cls, path: str | Path, drafter: str | None = "default", backend: str | None = None,
             threads: int | None = None, warmup: bool = True, device: str | None = None) -> Recommender:
        """Load the bundle at ``path`` (``specrec train`` writes one; ``bundles/beauty-loo`` is committed).

        ``drafter``: "sasrec", "retrieval", "self", None (no drafter: ``fused``, ``specgr`` and ``drafter`` then
        refuse), or "default" (:meth:`~specrec.bundle.Bundle.default_drafter`: sasrec where the bundle has it with a
        fusion, else retrieval, else self). ``backend``: "onnx" (default on the CPU), "eager", or "cuda" (the
        searches captured as CUDA graphs; the default where ``device`` is a GPU). ``device``: where the eager or
        cuda backend computes ("cuda", "cuda:1"; default the CPU).
        ``threads``: torch / ONNX Runtime intra-op threads. ``warmup``: run :meth:`warmup` (every policy ``auto``
        may choose, at K = 10), so a budget holds from the first call; ``False`` loads faster, and the first call
        of each policy then loads its graphs (about 0.1 s).
        """
        import torch

        from .bundle import Bundle

        if threads is not None:
            torch.set_num_threads(threads)
        bundle = Bundle.load(path)
        kind = bundle.default_drafter() if drafter == "default" else drafter
        if backend is None and device is not None and device.startswith("cuda"):
            backend = "cuda"
        kw: dict = {"threads": threads} if threads is not None and (backend or "onnx") == "onnx" else {}
        if device is not None:
            if backend not in ("eager", "cuda"):
                raise ValueError(f"device applies to the eager and cuda backends, not {backend or 'onnx'!r}")
            kw["device"] = device
        engine = bundle.engine(drafter=kind, backend=bundle.backend(backend, **kw))
        rec = cls(bundle, engine, kind)
        if warmup:
            rec.warmup()
        return rec

    def warmup(self, ks: Sequence[int] = (10,), policies: Sequence[str] | None = None, requests: int = 3) -> dict:
        """Make the first calls fast: every policy ``auto`` may choose (or ``policies``) runs once per K in ``ks`` on
        random catalogue histories, loading its graphs, then ``requests`` times more, so that what each costs is
        learned warm (what the cold first calls cost is forgotten: kept, ``auto`` would not choose a policy whose
        first call took 0.1 s for a while). Nothing of it is counted in the engine's metrics. -> seconds taken per
        policy."""
        from .costs import CostModel
        from .policies import RecRequest, make_policy
        from .policies.auto import AutoPolicy

        eng = self.engine
        if eng.verifier.backend.name == "cuda":  # every graph of these K, every batch bucket, captured before a call
            eng.verifier.backend.warmup(self.itemset.trie, tuple(ks), scored=self.bundle.scored_counts(tuple(ks)))
        names = list(policies) if policies is not None else [n for tier in AutoPolicy(eng).runnable() for n in tier]
        rows = np.flatnonzero(self.itemset.active)
        rng = np.random.default_rng(0)
        took = {}
        for warm in (False, True):
            if warm:
                eng.costs = CostModel(eng.costs.quantile, eng.costs.window)
            for name in names:
                t0 = time.perf_counter()
                pol = make_policy(name, eng)
                for k in ks:
                    for _ in range(requests if warm else 1):
                        h = rng.choice(rows, size=min(len(rows), int(rng.integers(1, eng.max_history + 1))))
                        pol.run([RecRequest(h, min(k, len(rows)))])
                if not warm:
                    took[name] = time.perf_counter() - t0
        eng.metrics.reset()
        return took

    # -- the catalogue -------------------------------------------------------------------
    @property
    def itemset(self):
        """The current in-process item set (:class:`~specrec.itemset.LocalItemSet`)."""
        return self.engine.itemset

    def __len__(self) -> int:
        return len(self.itemset)

    def __contains__(self, item_id: object) -> bool:
        r = self._index.get(str(item_id))
        return r is not None and bool(self.itemset.active[r])

    def _item(self, row: int, score: float = float("nan"), source: str = "") -> RecommendedItem:
        it = self.itemset
        return RecommendedItem(self._ids[row], tuple(int(c) for c in it.sids[row]), float(score), source,
                               not bool(it.seen[row]), self._titles[row])

    # -- answers ---------------------------------------------------------------------------
    def _rows(self, history: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        if isinstance(history, (str, bytes)):
            raise ValueError("history: a list of item ids, oldest first (got one string)")
        ids = [str(h) for h in history]
        if not ids:
            raise ValueError("history: empty: send at least one item id")
        active = self.itemset.active
        rows, ignored = [], []
        for i in ids:
            r = self._index.get(i)
            if r is None or not active[r]:
                ignored.append(i)
            else:
                rows.append(r)
        if not rows:
            raise ValueError(f"history: none of the {len(ids)} item ids is in catalogue version {self.itemset.version}")
        return np.asarray(rows, dtype=np.int64), ignored

    def _policy(self, policy: str, params: dict):
        from pydantic import ValidationError

        from .policies import POLICIES, make_policy

        if policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {policy!r} (known: {', '.join(sorted(POLICIES))})")
        if policy in ("fused", "specgr", "drafter") and self.engine.drafter is None:
            raise ValueError(f"policy: {policy!r} needs a drafter, and this recommender has none")
        try:
            return make_policy(policy, self.engine, **params)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"params.{'.'.join(str(x) for x in err['loc']) or '?'}: {err['msg']}") from None

    def recommend(self, history: Sequence[str], k: int = 10, policy: str = "auto", budget_ms: float | None = 30.0,
                  exclude_history: bool = False, **params) -> Recommendation:
        """The top-``k`` items for one history (item ids, oldest first; unknown ids are ignored and listed in
        ``stats.ignored_history``) by ``policy``, within ``budget_ms`` (None: no budget). With
        ``exclude_history`` no item of the history comes back (masked inside the trie constraint).

        Raises ValueError for bad input (naming the field) and
        :class:`~specrec.policies.Overloaded` when ``auto`` finds no policy that fits the budget.
        """
        from .deadline import Deadline
        from .policies import RecRequest

        if not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k: must be a positive integer, got {k!r}")
        if budget_ms is not None and budget_ms <= 0:
            raise ValueError(f"budget_ms: must be positive (or None: no budget), got {budget_ms}")
        t0 = time.perf_counter()
        rows, ignored = self._rows(history)
        pol = self._policy(policy, params)
        clock = self.engine.clock
        deadline = None if budget_ms is None else Deadline(clock() + budget_ms / 1000.0)
        left = len(self.itemset) - (len(np.unique(rows)) if exclude_history else 0)
        res = pol.run([RecRequest(rows, min(int(k), left), deadline, exclude_history=bool(exclude_history))])[0]
        st = res.stats
        stats = RecommendStats(
            policy=policy, served_by=res.served_by, rounds=st.rounds, drafted=st.draft_items,
            accepted=st.accepted_items, draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens,
            verifier_calls=st.verifier_calls, encoder_calls=st.encoder_calls, exit_reason=st.exit_reason,
            stage_ms={s: float(v) for s, v in st.stage_ms.items()}, catalogue_version=self.itemset.version,
            degraded=bool(res.degraded), degraded_reason=res.degraded,
            total_ms=(time.perf_counter() - t0) * 1000.0, ignored_history=ignored)
        items = [self._item(r, sc, src) for r, sc, src in zip(res.items.tolist(), res.scores.tolist(), res.sources)]
        return Recommendation(items, stats)

    def recommend_batch(self, histories: Iterable[Sequence[str]], k: int = 10, policy: str = "auto",
                        budget_ms: float | None = 30.0, progress: bool = True, exclude_history: bool = False,
                        **params) -> list[Recommendation]:
        """:meth:`recommend` for each history, in order (each with its own budget), with a progress bar
        (tqdm's in a terminal, plain lines in a log: :func:`specrec.terminal.progress_bar`)."""
        from .terminal import progress_bar

        histories = list(histories)
        return [self.recommend(h, k, policy, budget_ms, exclude_history, **params)
                for h in progress_bar(histories, desc=f"recommend ({policy})", unit="req", disable=not progress)]

    # -- catalogue updates -----------------------------------------------------------------
    def upsert(self, item: dict | None = None, **fields) -> RecommendedItem:
        """Add an item to the in-process item set (or replace the one with its id), without retraining.

        ``item`` (or keyword arguments) as a line of ``items.jsonl``: ``item_id`` (required), and ``text``, or
        ``title`` / ``brand`` / ``categories`` joined into one. Its semantic ID comes from that text
        (all-MiniLM-L6-v2 and the bundle's RQ codebooks, a free collision digit), the drafter indexes it,
        and it is unseen (scored with the L-1 rule). Returns the item as stored; the catalogue version goes
        up by one.
        """
        from .data.dataset import item_text

        obj = {**(item or {}), **fields}
        if obj.get("item_id") in (None, ""):
            raise ValueError("item_id: required")
        item_id = str(obj["item_id"])
        text = item_text(obj)
        if not text.strip():
            raise ValueError("text: required (or title / brand / categories)")
        title = str(obj.get("title") or obj.get("name") or "")
        emb = self._embed([text])
        old = self.itemset
        active = old.active.copy()
        if item_id in self._index:
            active[self._index[item_id]] = False  # the old row is replaced by the new one
        sem = self.bundle.semantic_ids
        sid = sem.assign(emb, old.sids[active]).sids  # [1, L]
        base = type(old)(old.sids, old.seen, old.level_sizes, old.version, active)
        new = base.with_items(sid)
        _ = new.trie  # built here (~0.1 s on Beauty), not inside the next request's budget
        row = old.n_rows
        drafter = self.engine.drafter
        if drafter is not None:
            if self.drafter_kind in ("retrieval", "sasrec"):  # text-aware: the new item's text embedding
                drafter.add_items(new, emb)
            else:
                drafter.add_items(new)
        self.engine.itemset = new
        self._ids.append(item_id)
        self._titles.append(title)
        self._texts.append(text)
        self._index[item_id] = row
        return self._item(row)

    def _embed(self, texts: list[str]) -> np.ndarray:
        if self._embedder is None:
            from .ids.embed import TextEmbedder

            self._embedder = TextEmbedder(progress=False)
        embed = self._embedder
        return np.asarray(embed(texts), dtype=np.float32)

    def __repr__(self) -> str:
        return (f"Recommender({self.bundle.name!r}, {len(self)} items, catalogue version {self.itemset.version}, "
                f"drafter {self.drafter_kind})")
