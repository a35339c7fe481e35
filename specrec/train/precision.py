"""Choosing the precision of the scoring graphs on validation users (``specrec export-onnx``): the rule and the
record are :mod:`specrec.backends.precision`'s; this is the part that needs the bundle's data and its policies.

The scoring pass (``rank``) is judged by the fused list's recall@10 on users scored as ``specrec tune-fusion``
scores them (:func:`_rank_record`), ``nezha``'s graphs (``draft``) by ``nezha``'s recall@10
(:func:`_draft_record`); :func:`choose_precisions` writes the choice beside the graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..backends.export import ENC
from ..backends.onnx import OrtBackend
from ..backends.precision import (
    FLOAT32,
    KINDS,
    TOLERANCE,
    candidates,
    cpu_flags,
    decide,
    remove_unchosen,
    run_feed,
    time_sessions,
    variant_name,
    write_precision,
)
from ..bundle import Bundle, bundle_split
from ..data.splits import sample_examples
from ..fusion import recall_ndcg
from ..policies import RecRequest, make_policy
from .fusion import score_users


class _Scoring:
    """A backend for :func:`specrec.train.fusion.score_users` that runs the scoring pass in every precision of
    ``sessions`` on the same inputs, keeps each one's outputs and answers with float32's; with ``record``, it keeps
    the inputs instead (batch 1 feeds to time with)."""

    def __init__(self, backend: OrtBackend, sessions: dict[str, Any], record: bool = False):
        self.backend, self.sessions, self.record = backend, sessions, record
        self.outputs: dict[str, list[np.ndarray]] = {p: [] for p in sessions}
        self.feeds: list[dict] = []

    def encode(self, hist):
        return self.backend.encode(hist)

    def search(self, name: str, enc, trie, widths, args):
        """The scoring pass (``rank``, the one search score_users runs) in every precision of ``sessions``."""
        from ..decoding.searches.rank import INPUTS, layout

        assert name == "rank" and trie is None and not widths, (name, widths)
        sids = args["sids"]
        feed = dict(zip([*ENC, *INPUTS], [enc.keep.numpy(), enc.cross_k.numpy(), enc.cross_v.numpy(),
                                          *layout(sids.numpy())]))
        if self.record:
            self.feeds.append(feed)
        for p, s in self.sessions.items():
            self.outputs[p].append(run_feed(s, feed)[0])
        return torch.from_numpy(self.outputs[FLOAT32][-1])


def _validation(bundle: Bundle, users: int, seed: int):
    """(examples, their whole histories, the sample's description) of the bundle's validation users, or a reason
    there are none."""
    try:
        ds, split = bundle_split(bundle)
    except (SystemExit, OSError, ValueError) as e:
        return f"no validation users: {e}"
    ex = sample_examples(split.valid, users, seed)
    return ex, ex.full_histories(ds.sequences), f"{len(ex)} validation users (seed {seed}), history excluded"


def choose_kind(backend: OrtBackend, kind: str, cands: Sequence[str], feeds: Sequence[dict],
                recall_of: Callable[[dict[str, str]], dict[str, float]], widths: Sequence[int | None] = (None,),
                tables: str = "") -> dict:
    """The precision of graph ``kind`` of ``backend`` (float32 graphs; reading tables of the forms ``tables``, where
    it reads any), among ``cands``: each one's graphs of ``widths`` built, timed side by side on ``feeds`` (batch 1;
    ms: the sum over the widths), and those faster than float32 checked by ``recall_of`` ({precision: graph name of
    the first width} -> recall of each, float32's included) -> the record's entry (the choice, each candidate's
    figures: :func:`decide`)."""
    names = {(p, w): backend._exported(kind, w, precision=p, tables=tables) for p in cands for w in widths}
    run = {f"{p}@{w}": functools.partial(run_feed, backend._session(name)) for (p, w), name in names.items()}
    per = time_sessions(run, feeds)
    ms = {p: round(sum(per[f"{p}@{w}"] for w in widths), 3) for p in cands}
    faster = {p: names[(p, widths[0])] for p in cands if p == FLOAT32 or ms[p] < ms[FLOAT32]}
    chosen, table = decide(ms, {**dict.fromkeys(cands), **recall_of(faster)})
    if len(widths) > 1:
        for p, row in table.items():
            row["ms_by_width"] = {str(w): per[f"{p}@{w}"] for w in widths}
    return {"chosen": chosen, "graph": variant_name(names[(FLOAT32, widths[0])], chosen), "candidates": table}


def _rank_record(bundle: Bundle, backend: OrtBackend, cands: list[str], ex, full, sample: str, timing_users: int,
                 progress: bool) -> dict:
    """The scoring pass's precision: timed on the first ``timing_users`` users' own candidates, judged by the fused
    list's recall@10 on all of ``ex`` (their candidates and both models' scores as ``tune-fusion`` makes them)."""
    fusion = bundle.fusion
    assert fusion is not None
    share = float(bundle.meta.get("drafters", {}).get("unseen_share", 0.0))
    probe = _Scoring(backend, {FLOAT32: backend._session(backend._exported("rank", None, precision=FLOAT32))},
                     record=True)
    n_time = min(timing_users, len(ex))
    score_users(bundle, ex.take(np.arange(n_time)), full[:n_time], fusion.drafts, backend=probe, batch_size=1,
                progress=False)

    def recall_of(graphs: dict[str, str]) -> dict[str, float]:
        tee = _Scoring(backend, {p: backend._session(name) for p, name in graphs.items()})
        scored = score_users(bundle, ex, full, fusion.drafts, backend=tee, progress=progress)
        out = {}
        for p in graphs:
            rows = iter(row for o in tee.outputs[p] for row in o)
            users = [dataclasses.replace(u, token_logp=next(rows)[: len(u.items)].astype(np.float64)) for u in scored]
            out[p] = recall_ndcg(users, fusion, 10, share)[0]
        return out

    return {**choose_kind(backend, "rank", cands, probe.feeds, recall_of),
            "judged_by": f"the fused list's recall@10 (weight {fusion.weight}, {fusion.norm}, {fusion.drafts} SASRec "
                         f"candidates, {share:.0%} kept for unseen items) on {sample}",
            "timed_on": f"{n_time} of those users' candidates, batch 1, median of 2 rounds after one to warm up"}


def _nezha_recall(bundle: Bundle, backend: OrtBackend, ex, full, k: int = 10) -> float:
    """nezha's recall@k on the users of ``ex`` (history excluded), on ``backend``."""
    pol = make_policy("nezha", bundle.engine(drafter=None, backend=backend))
    hits = 0
    for i in range(len(ex)):
        res = pol.run([RecRequest(np.asarray(full[i], np.int64), k, exclude_history=True)])[0]
        hits += int(int(ex.target[i]) in res.items[:k].tolist())
    return hits / max(1, len(ex))


def _draft_record(bundle: Bundle, backend: OrtBackend, cands: list[str], ex, full, sample: str, timing_users: int,
                  k: int = 10) -> dict:
    """nezha's graphs' precision (the distilled drafter's search, of width K and 2K: nezha's default width and its
    wider option; every width then runs the chosen precision): timed on the first ``timing_users`` users'
    histories, judged by nezha's recall@K on all of ``ex``."""
    tag, tables = backend.table_feed(bundle.trie)
    feeds = []
    with torch.inference_mode():
        for i in range(min(timing_users, len(ex))):
            enc = backend.encode(bundle.history_sids([np.asarray(full[i], np.int64)]))
            feeds.append({**dict(zip(ENC, (enc.keep.numpy(), enc.cross_k.numpy(), enc.cross_v.numpy()))), **tables})

    def recall_of(graphs: dict[str, str]) -> dict[str, float]:
        return {p: _nezha_recall(bundle, backend if p == FLOAT32 else OrtBackend(
            backend.model, backend.nezha_head, onnx_dir=backend.onnx_dir, drafter=backend.drafter,
            threads=backend.threads, precision={"draft": p}), ex, full, k) for p in graphs}

    entry = choose_kind(backend, "draft", cands, feeds, recall_of, widths=(k, 2 * k), tables=tag)
    entry["graph"] = entry["graph"].replace(f"_w{k}", "_w{W}")
    return {**entry, "judged_by": f"nezha's recall@{k} on {sample}",
            "timed_on": f"{len(feeds)} of those users, the draft graphs of width {k} and {2 * k} (ms: their sum), "
                        "batch 1, median of 2 rounds after one to warm up"}


def choose_precisions(bundle: Bundle, backend: OrtBackend, users: int = 2000, seed: int = 0,
                      forced: Sequence[str] | str | None = None, timing_users: int = 100,
                      progress: bool = False) -> dict:
    """Choose and record (in ``backend``'s graphs directory) the precision of each of :data:`KINDS` on this
    machine (see the module's docstring); ``backend`` runs float32. -> the record."""
    import onnxruntime as ort

    cpu = cpu_flags()
    cands, left = candidates(cpu, forced)
    record: dict[str, Any] = {"cpu": cpu, "onnxruntime": ort.__version__, "tolerance": TOLERANCE,
                              "candidates": cands, "left_out": left}
    why: str | None = None
    if len(cands) == 1:
        why = "float32 is the only candidate"
    val = None if why else _validation(bundle, users, seed)
    if isinstance(val, str):
        why = val
    for kind in KINDS:
        if kind == "rank" and (bundle.fusion is None or bundle.sasrec is None):
            record[kind] = {"chosen": FLOAT32, "graph": "rank", "why": "no fusion to judge the scoring pass by"}
        elif kind == "draft" and backend.drafter is None:
            record[kind] = {"chosen": FLOAT32, "why": "no distilled drafter"}
        elif why is not None or val is None or isinstance(val, str):
            record[kind] = {"chosen": FLOAT32, "why": why}
        else:
            ex, full, sample = val
            t0 = time.perf_counter()
            rec = (_rank_record(bundle, backend, cands, ex, full, sample, timing_users, progress) if kind == "rank"
                   else _draft_record(bundle, backend, cands, ex, full, sample, timing_users))
            record[kind] = {**rec, "seconds": round(time.perf_counter() - t0, 1)}
    write_precision(backend.onnx_dir, record)
    remove_unchosen(backend.onnx_dir, record)
    return record
