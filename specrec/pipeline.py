"""From a dataset to a trained bundle: split, embed, semantic IDs, train."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .bundle import DEMO_HISTORIES, Bundle, data_path_for, round_to_half
from .data.dataset import Dataset
from .data.open import open_dataset
from .data.splits import Split, make_split
from .ids.embed import TextEmbedder
from .ids.semantic import SemanticIds
from .models.tiger import TigerConfig
from .train.trainer import TrainConfig, Trainer

#: where an item's semantic ID comes from (``specrec train --sid-source``): its text, or the item embedding SASRec
#: learns from the interactions; ``auto``: the text where at least :data:`TEXT_SHARE` of the items have one
SID_SOURCES = ("auto", "text", "sasrec")
TEXT_SHARE = 0.5


def resolve_sid_source(ds: Dataset, source: str = "auto") -> str:
    """``text`` or ``sasrec`` for ``source`` on ``ds``: ``auto`` takes the text where at least :data:`TEXT_SHARE`
    of the items have one (an item without is ``item <id>`` to the text model: a code that says nothing), else
    what the interactions say of the items."""
    if source not in SID_SOURCES:
        raise ValueError(f"sid source {source!r}: one of {SID_SOURCES}")
    if source != "auto":
        return source
    return "text" if ds.catalogue.described_share() >= TEXT_SHARE else "sasrec"


def sasrec_item_embeddings(ds: Dataset, split: Split, epochs: int = 20, seed: int = 0, progress: bool = True,
                           log: Callable[[str], None] = print) -> tuple[np.ndarray, dict]:
    """Item embeddings learnt from the interactions alone, for data without item texts: a SASRec (the baseline's
    defaults, :mod:`specrec.train.baseline`) trained on the split's training sequences, its best epoch by
    validation NDCG@10, and its item embedding table (the one its scores are inner products with) L2-normalised,
    as the text embeddings are. -> ([n_items, d] float32, what was trained)."""
    from .models.sasrec import SASRecConfig
    from .train.baseline import train_sasrec
    from .train.drafters import DrafterTrainConfig

    t0 = time.time()
    cfg = SASRecConfig(n_items=ds.n_items, max_history=split.max_history)
    tcfg = DrafterTrainConfig(epochs=epochs, batch_size=128, lr=1e-3, patience=5, seed=seed)
    model, rep = train_sasrec(split, [s.items for s in ds.sequences], ds.n_items, cfg, tcfg, log=log,
                              progress=progress)
    emb = model.item.weight[1:].detach().float().numpy()
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    info = {"model": "sasrec", "d_model": cfg.d_model, "epochs": len(rep["epochs"]),
            "best_valid_ndcg@10": rep["best_valid_ndcg@10"], "minutes": round((time.time() - t0) / 60.0, 1)}
    return emb.astype(np.float32), info


def fit_semantic_ids(
    ds: Dataset, split: Split, embedder: Callable | None = None, seed: int = 0,
    n_levels: int = 3, codebook_size: int = 256, collision_size: int = 256, emb: np.ndarray | None = None,
) -> tuple[SemanticIds, np.ndarray, dict]:
    """Fit RQ codebooks on the items seen in training, then give every item a
    SID: seen items first (catalogue order), unseen ones inductively after.
    ``emb`` [n_items, d]: the items' embeddings (default: their texts' by ``embedder``)."""
    if emb is None:
        embedder = embedder or TextEmbedder(progress=True)
        emb = embedder(ds.catalogue.texts)
    seen = split.seen
    sem = SemanticIds.fit(emb[seen], n_levels, codebook_size, collision_size, seed=seed)
    sids = np.zeros((ds.n_items, n_levels + 1), dtype=np.int64)
    sids[seen] = sem.assign_all(emb[seen])
    report = {}
    if (~seen).any():
        a = sem.assign(emb[~seen], sids[seen])
        sids[~seen] = a.sids
        report["inductive"] = a.report
    report.update(sem.report(sids).as_dict())
    return sem, sids, report


def write_demo_histories(bundle_dir: str | Path, split, n: int = 50, seed: int = 7) -> Path:
    """A seeded random sample of held-out test histories (item ids) with their targets, shipped in the
    bundle: the local stack's demo shows the real model without the dataset."""
    from .data.splits import sample_examples

    ex = sample_examples(split.test, n, seed)
    ids = [json.loads(line)["item_id"] for line in (Path(bundle_dir) / "items.jsonl").read_text().splitlines()]
    rows = ex.histories()
    demo = [{"history": [ids[r] for r in h], "target": ids[int(t)]} for h, t in zip(rows, ex.target)]
    p = Path(bundle_dir) / DEMO_HISTORIES
    p.write_text(json.dumps({"source": f"{len(demo)} test users, a seeded random sample (seed {seed})",
                             "users": demo}) + "\n")
    return p


def build(
    data: str | Path | None,
    out: str | Path,
    protocol: str = "loo",
    model_cfg: TigerConfig | None = None,
    train_cfg: TrainConfig | None = None,
    quantile: float = 0.8,
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    embedder: Callable | None = None,
    log: Callable[[str], None] = print,
    sids_from: str | Path | None = None,
    sid_source: str = "auto",
    sid_sasrec_epochs: int = 20,
) -> Bundle:
    """Split, semantic IDs, train, and write ``out/bundle``. ``sids_from`` (a
    bundle of the same dataset) reuses its semantic IDs and text embeddings
    instead of fitting new ones, so that a retrained model keeps the item
    codes its drafters and item-set store already use. ``sid_source``: what the
    semantic IDs quantise (:func:`resolve_sid_source`: the items' texts, or
    where the data has none, the item embeddings a SASRec learns from the
    training interactions, :func:`sasrec_item_embeddings`)."""
    t_build = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ds = open_dataset(data)
    model_cfg = model_cfg or TigerConfig()
    train_cfg = train_cfg or TrainConfig(seed=seed)
    split = make_split(ds, protocol, model_cfg.max_history, quantile)
    log(f"dataset {ds.name}: {ds.n_items} items, {len(ds.sequences)} users, {ds.n_interactions()} interactions")
    log(f"split {json.dumps(split.describe())}")
    t0 = time.time()
    text_emb = None
    if sids_from is not None:
        src = Bundle.load(sids_from)
        if src.catalogue.ids != ds.catalogue.ids:
            raise ValueError(f"{sids_from}: its catalogue is not the dataset's")
        if list(src.cfg.level_sizes) != list(model_cfg.level_sizes):
            raise ValueError(f"{sids_from}: its SID levels {src.cfg.level_sizes} differ from {model_cfg.level_sizes}")
        sem, sids, sid_report, text_emb = src.semantic_ids, src.sids, src.meta["sid_report"], src.text_emb
        source, source_info = src.meta.get("sid_source", "text"), src.meta.get("sid_source_info")
        log(f"semantic IDs from {sids_from}")
    else:
        source, source_info, emb = resolve_sid_source(ds, sid_source), None, None
        share = ds.catalogue.described_share()
        if source == "sasrec":
            log(f"semantic IDs from the interactions: {share:.0%} of the items have a text (sid source "
                f"{sid_source}); SASRec's item embeddings quantised")
            emb, source_info = sasrec_item_embeddings(ds, split, sid_sasrec_epochs, seed, progress, log)
        else:
            source_info = {"described_share": share}
        sem, sids, sid_report = fit_semantic_ids(
            ds,
            split,
            embedder,
            seed=seed,
            n_levels=len(model_cfg.level_sizes) - 1,
            codebook_size=model_cfg.level_sizes[0],
            collision_size=model_cfg.level_sizes[-1],
            emb=emb,
        )
    lv = ", ".join(f"L{x['level']} {x['used']}/{x['size']}" for x in sid_report["levels"])
    log(f"semantic IDs in {time.time() - t0:.0f}s: codebook usage {lv}; {sid_report['items_with_collision']} items "
        f"need a collision digit > 0 (max {sid_report['max_collision_digit']})")
    (out / "sid_report.json").write_text(json.dumps(sid_report, indent=2) + "\n")

    trainer = Trainer(model_cfg, train_cfg, sids, split.train, split.valid, out, log=log, test=split.test)
    if resume:
        trainer.resume()
    summary = trainer.fit(progress=progress)
    summary["train_minutes"] = round(sum(h["train_s"] + h.get("valid_s", 0.0) + h.get("test_s", 0.0)
                                         for h in trainer.history) / 60.0, 1)
    summary["curve"] = [{k: h[k] for k in h if k in ("epoch", "step", "minutes", "loss", "lr") or "@" in k}
                        for h in trainer.history]
    summary["wall_minutes_this_session"] = round((time.time() - t_build) / 60.0, 1)
    summary["params"] = trainer.model.n_params()
    meta = {
        "dataset": ds.name, "data_path": data_path_for(data, out / "bundle"), "protocol": protocol,
        "cutoff": split.cutoff, "quantile": quantile if protocol == "temporal" else None, "seed": seed,
        "train": train_cfg.model_dump(), "training": summary, "split": split.describe(), "sid_report": sid_report,
        "sid_source": source, "sid_source_info": source_info,
    }
    if sids_from is not None:
        meta["sids_from"] = str(sids_from)
    bundle = Bundle(ds.name, ds.catalogue, sem, sids, split.seen.copy(), round_to_half(trainer.model), meta,
                    text_emb=text_emb)
    bundle.save(out / "bundle")
    write_demo_histories(out / "bundle", split)
    log(f"bundle written to {out / 'bundle'} ({summary['train_minutes']} min of training)")
    return bundle


def train_drafters(
    bundle: Bundle,
    out: str | Path,
    which: tuple[str, ...] = ("retrieval", "self", "nezha"),
    data: str | Path | None = None,
    epochs: dict | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    align=None,
    distill=None,
    device: str = "cpu",
    batch_scale: float = 1.0,
) -> Bundle:
    """Train the drafters of a bundle on its own split and save the bundle to
    ``out``; ``align`` (:class:`~specrec.train.align.AlignConfig`) aligns the
    NEZHA head and the self-drafter to the GR model (AtSpeed); ``which`` may name
    "distill": the SID-MLP drafter distilled from the GR model (``distill``:
    its :class:`~specrec.train.distill.DistillConfig`). Each trains on ``device``
    with ``batch_scale`` times its batch (:func:`specrec.train.device.scale_batch`)."""
    from .data.splits import temporal
    from .ids.embed import cache_dir
    from .train.device import scale_batch
    from .train.drafters import DrafterTrainConfig, train_nezha, train_retrieval, train_self_draft

    def tcfg(epochs: int, batch_size: int, lr: float, **kw) -> DrafterTrainConfig:
        b, r, _ = scale_batch(batch_size, lr, batch_scale)
        return DrafterTrainConfig(epochs=epochs, batch_size=b, lr=r, device=device, **kw)

    def recorded(tc: DrafterTrainConfig, t0: float) -> dict:  # the batch it trained with, and its minutes
        return {"batch_size": tc.batch_size, "lr": tc.lr, "minutes": round((time.time() - t0) / 60, 1)}

    ds = open_dataset(data or bundle.data_path)
    if ds.catalogue.ids != bundle.catalogue.ids:
        raise ValueError("the dataset does not have the bundle's catalogue")
    if bundle.meta.get("protocol") == "temporal":
        split = temporal(ds, bundle.cfg.max_history, cutoff=int(bundle.meta["cutoff"]))
    else:
        split = make_split(ds, bundle.meta.get("protocol", "loo"), bundle.cfg.max_history)
    epochs = epochs or {}
    info = bundle.meta.setdefault("drafters", {})
    if "retrieval" in which:
        if bundle.text_emb is None:
            bundle.text_emb = TextEmbedder(progress=progress)(bundle.catalogue.texts)
        t0, tc = time.time(), tcfg(epochs.get("retrieval", 30), 128, 1e-3)
        model, rep = train_retrieval(split, [s.items for s in ds.sequences], bundle.text_emb, tcfg=tc, log=log,
                                     progress=progress)
        bundle.retrieval = round_to_half(model)
        info["retrieval"] = {**rep, **recorded(tc, t0)}
    if "self" in which:
        t0, tc = time.time(), tcfg(epochs.get("self", 8), 256, 2e-3)
        self_head, rep = train_self_draft(bundle.model, split, bundle.sids, tcfg=tc, log=log, progress=progress,
                                          align=align, cache=cache_dir() / "beams")
        bundle.self_draft = round_to_half(self_head)
        info["self_draft"] = {**rep, **recorded(tc, t0)}
    if "nezha" in which:
        t0, tc = time.time(), tcfg(epochs.get("nezha", 5), 256, 2e-3, patience=2)
        head, rep = train_nezha(bundle.model, split, bundle.sids, tcfg=tc, log=log, progress=progress, align=align,
                                cache=cache_dir() / "beams")
        bundle.nezha_head = round_to_half(head)
        info["nezha_head"] = {**rep, **recorded(tc, t0)}
    if "distill" in which:
        from .train.distill import DistillConfig, train_sid_mlp

        dcfg = distill or DistillConfig()
        b, r, _ = scale_batch(dcfg.batch_size, dcfg.lr, batch_scale)
        dcfg = dcfg.model_copy(update={"batch_size": b, "lr": r, "device": device})
        drafter, rep = train_sid_mlp(bundle.model, split, bundle.sids, dcfg, log=log,
                                     progress=progress, cache=cache_dir() / "frontier")
        bundle.sid_mlp = round_to_half(drafter)
        info["sid_mlp"] = rep
    bundle.save(out)
    log(f"bundle with drafters written to {out}")
    return bundle
