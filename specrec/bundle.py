"""A trained bundle: everything needed to serve or evaluate one model.

A bundle directory holds

- ``bundle.json``        name, dataset, protocol, model/drafter configs, training summaries;
- ``items.jsonl``        per item: id, title, text, SID, seen flag (catalogue order);
- ``codebooks.npy``      RQ codebooks [L, C, D] for inductive SIDs of new items;
- ``model.safetensors``  the GR model's weights (stored in float16, run in float32);

and, once drafters are trained (``specrec train-drafters``):

- ``text_emb.npy``       item text embeddings (float16), for the retrieval drafter;
- ``retrieval.safetensors``, ``self_draft.safetensors``, ``nezha_head.safetensors``;
- ``sid_mlp.safetensors`` the drafter distilled from the GR model (``specrec distill``), which
  ``strict``, ``nezha`` and ``specgr`` draft with when present;

and, once the baseline is trained (``specrec train-baseline``):

- ``sasrec.safetensors`` the SASRec baseline on the same split.

Weights are stored in half precision to keep the committed bundle small; the
loaded model is the float32 upcast of those weights, and every figure in
``bench/results`` is measured on the loaded bundle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from .data.dataset import Catalogue, Dataset
from .data.histories import history_codes
from .data.splits import Split
from .ids.semantic import SemanticIds
from .ids.trie import SidTrie
from .itemset import LocalItemSet
from .models.nezha_head import NezhaConfig, NezhaHead
from .models.retrieval import RetrievalConfig, RetrievalModel
from .models.sasrec import SASRec, SASRecConfig
from .models.self_draft import SelfDraftConfig, SelfDraftHead
from .models.sid_mlp import SidMlpConfig, SidMlpDrafter
from .models.tiger import Tiger, TigerConfig

FORMAT_VERSION = 1


def save_weights(module: nn.Module, path: Path, half: bool = True) -> None:
    from safetensors.torch import save_file

    state = {}
    for k, v in module.state_dict().items():
        v = v.detach().contiguous()
        state[k] = v.half() if half and v.is_floating_point() else v
    save_file(state, str(path))


M = TypeVar("M", bound=nn.Module)


def load_weights(module: M, path: Path) -> M:
    from safetensors.torch import load_file

    ref = module.state_dict()
    state = {k: v.to(ref[k].dtype) for k, v in load_file(str(path)).items()}
    module.load_state_dict(state)
    return module.eval()


def round_to_half(module: M) -> M:
    """Round float weights through float16, as saving and loading would."""
    with torch.no_grad():
        for p in module.state_dict().values():
            if p.is_floating_point():
                p.copy_(p.half().float())
    return module



def read_meta(path: str | Path) -> dict:
    """A bundle's ``bundle.json``, checked for the format version (loads no weights)."""
    path = Path(path)
    if not (path / "bundle.json").exists():
        raise FileNotFoundError(f"not a bundle directory (no bundle.json): {path}")
    meta = json.loads((path / "bundle.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: bundle format {meta.get('format_version')} != {FORMAT_VERSION}")
    return meta


def data_path_of(data_path: str | None, bundle_dir: str | Path | None) -> str | None:
    """Where a bundle's dataset is, from its ``data_path`` (``bundle.json``) and the bundle's directory.

    A relative ``data_path`` is relative to the bundle's own directory (``bundles/beauty-loo``: ``../../data/beauty``,
    the repository's copy), so a bundle finds its data whatever the working directory. Bundles written before that
    rule held a path relative to the directory they were built from (``../shared/data/beauty``): where the path
    does not resolve from the bundle's directory but does from the working directory, that one is taken. An
    absolute path, ``synthetic`` and None (the synthetic catalogue) are as they are. Where neither resolves, the
    path from the bundle's directory (what an error message should name)."""
    if data_path is None or data_path == "synthetic" or bundle_dir is None or Path(data_path).is_absolute():
        return data_path
    here = Path(bundle_dir) / data_path
    if not here.is_dir() and Path(data_path).is_dir():  # an older bundle's path, relative to the working directory
        return data_path
    return str(here)


def data_path_for(data: str | Path | None, bundle_dir: str | Path) -> str | None:
    """What a bundle saved to ``bundle_dir`` records as its ``data_path`` for the dataset at ``data`` (a path as
    the user gave it, relative to the working directory): relative to ``bundle_dir`` (:func:`data_path_of` reads
    it back from anywhere); an absolute path, ``synthetic`` and None as they are."""
    if data is None or str(data) == "synthetic" or Path(data).is_absolute():
        return None if data is None else str(data)
    return _relative(data, bundle_dir)


def _relative(data: str | Path, bundle_dir: str | Path) -> str:
    return os.path.relpath(Path(data).resolve(), Path(bundle_dir).resolve())


def sid_space_fingerprint(path: str | Path) -> str:
    """What ties a catalogue to a bundle: the SID space (level sizes and RQ codebooks), hashed.
    A catalogue made for one bundle is valid for another with the same fingerprint. A catalogue-only
    bundle (no codebooks, as a loader's test bundle) is identified by its level sizes alone."""
    import hashlib

    path = Path(path)
    meta = read_meta(path)
    h = hashlib.sha256(json.dumps(meta["model"]["level_sizes"]).encode())
    if (path / "codebooks.npy").exists():
        h.update((path / "codebooks.npy").read_bytes())
    return h.hexdigest()[:16]


@dataclass
class Bundle:
    name: str
    catalogue: Catalogue
    semantic_ids: SemanticIds
    sids: np.ndarray  # [N, L] int64
    seen: np.ndarray  # [N] bool
    model: Tiger
    meta: dict = field(default_factory=dict)
    text_emb: np.ndarray | None = None  # [N, 384]
    retrieval: RetrievalModel | None = None
    self_draft: SelfDraftHead | None = None
    nezha_head: NezhaHead | None = None
    sid_mlp: SidMlpDrafter | None = None
    sasrec: SASRec | None = None
    path: Path | None = None  # the directory it was loaded from (its prebuilt graphs live in ``path / "onnx"``)

    def __post_init__(self) -> None:
        if self.sids.shape != (len(self.catalogue), self.model.cfg.sid_len):
            raise ValueError(f"sids shape {self.sids.shape} does not match catalogue/model")
        self.model.eval()
        self.sids_t = torch.from_numpy(np.ascontiguousarray(self.sids, dtype=np.int64))

    @property
    def cfg(self) -> TigerConfig:
        return self.model.cfg

    @property
    def data_path(self) -> str | None:
        """Where the dataset the bundle was trained on is (:func:`data_path_of`); None: the synthetic catalogue."""
        return data_path_of(self.meta.get("data_path"), self.path)

    @property
    def fusion(self):
        """How ``specgr`` ranks by both models (the GR and the bundle's SASRec), as ``specrec tune-fusion`` chose
        on validation users (:class:`specrec.fusion.Fusion`); None where it has none."""
        from .fusion import Fusion

        return Fusion.of(self.meta.get("fusion")) if self.sasrec is not None else None

    def scored_counts(self, ks) -> tuple[int, ...]:
        """The candidate counts ``specgr`` scores when it ranks by both models, for lists of ``ks``: the scoring
        graphs a deployment of those K warms up (none without a fusion)."""
        f = self.fusion
        return () if f is None else tuple(sorted({f.candidates(k) for k in ks}))

    @cached_property
    def itemset(self) -> LocalItemSet:
        return LocalItemSet(self.sids, self.seen, self.cfg.level_sizes, version="1")

    @property
    def trie(self) -> SidTrie:
        return self.itemset.trie

    def history_sids(self, histories: list[np.ndarray] | np.ndarray) -> torch.Tensor:
        """Item-index histories (ragged lists, or [R, H] padded with -1) ->
        [R, max_history, L] codes, left-padded with -1 rows."""
        return torch.from_numpy(history_codes(histories, self.cfg.max_history, self.sids))

    # -- serving pieces ----------------------------------------------------------
    def default_drafter(self) -> str | None:
        """The bundle's best item drafter (in-process and the drafter service's default mode): SASRec where it has
        a fusion chosen on validation (``specrec tune-fusion``: ``specgr`` then ranks by both models), else the
        text-aware retrieval drafter, else the self-drafter, else a SASRec without a fusion; None without any."""
        if self.fusion is not None:
            return "sasrec"
        if self.retrieval is not None and self.text_emb is not None:
            return "retrieval"
        if self.self_draft is not None:
            return "self"
        return "sasrec" if self.sasrec is not None else None

    def drafter(self, kind: str = "retrieval", itemset: LocalItemSet | None = None, text_share: float | None = None,
                unseen_share: float | None = None, unseen_source=None):
        """A drafter over the bundle's catalogue: ``retrieval`` (text-aware), ``self`` (the GR encoder's own
        state) or ``sasrec`` (the bundle's SASRec, its unseen share drafted by the retrieval drafter's text part;
        :mod:`specrec.drafters.sasrec`). ``text_share`` / ``unseen_share``: the share of text-similarity
        candidates among all items / among the unseen ones; default: the bundle's, ``drafters.text_share`` /
        ``drafters.unseen_share`` in bundle.json, else 0). ``unseen_source``: for ``sasrec``, the retrieval drafter
        to draw the unseen items from (a service shares its own; default: one made here, where the bundle has it)."""
        itemset = itemset or self.itemset
        if kind == "retrieval":
            from .drafters.retrieval import RetrievalDrafter

            if self.retrieval is None or self.text_emb is None:
                raise ValueError(f"bundle {self.name!r} has no retrieval drafter (run `specrec train-drafters`)")
            meta = self.meta.get("drafters", {})
            share = meta.get("text_share", 0.0) if text_share is None else text_share
            new = meta.get("unseen_share", 0.0) if unseen_share is None else unseen_share
            return RetrievalDrafter(self.retrieval, self.text_emb, itemset, text_share=share, unseen_share=new)
        if kind == "self":
            from .drafters.self_draft import SelfDrafter

            if self.self_draft is None:
                raise ValueError(f"bundle {self.name!r} has no self-draft head (run `specrec train-drafters`)")
            return SelfDrafter(self.model, self.self_draft, itemset)
        if kind == "sasrec":
            from .drafters.sasrec import SasrecDrafter

            if self.sasrec is None:
                raise ValueError(f"bundle {self.name!r} has no SASRec (run `specrec train-baseline`)")
            new = self.meta.get("drafters", {}).get("unseen_share", 0.0) if unseen_share is None else unseen_share
            text = unseen_source  # the unseen share, and items SASRec has no vector for (new ones), by text
            if text is None and self.retrieval is not None and self.text_emb is not None:
                text = self.drafter("retrieval", itemset, text_share=0.0, unseen_share=new)
            return SasrecDrafter(self.sasrec, itemset, text, new if text is not None else 0.0, self.fusion)
        raise ValueError(f"unknown drafter {kind!r} (expected 'retrieval', 'self' or 'sasrec')")

    def backend(self, name: str | None = None, **kw):
        """The GR model's hot path on a backend (:mod:`specrec.backends`; default: the fastest, ONNX Runtime)."""
        from .backends import DEFAULT_BACKEND, make_backend

        kw.setdefault("drafter", self.sid_mlp)
        name = name or DEFAULT_BACKEND
        if name == "onnx" and kw.get("onnx_dir") is None:
            kw["onnx_dir"] = self.prebuilt_graphs(kw["drafter"])
        return make_backend(name, self.model, self.nezha_head, **kw)

    def prebuilt_graphs(self, drafter=None) -> Path | None:
        """``path / "onnx"`` when it holds graphs built for exactly these weights (``specrec export-onnx``),
        else None (the backend exports into its cache on first use)."""
        from .backends.onnx import graphs_current

        d = None if self.path is None else self.path / "onnx"
        return d if d is not None and graphs_current(d, self.model, self.nezha_head, drafter) else None

    def engine(self, drafter: str | None = "retrieval", backend=None, **drafter_kw):
        """An in-process engine: local verifier on ``backend`` (default: the
        default backend), the bundle's item set, and a drafter (``drafter_kw``: see :meth:`drafter`)."""
        from .policies.engine import Engine
        from .verifier import LocalVerifier

        verifier = LocalVerifier(backend if backend is not None else self.backend(), self.nezha_head, self.model)
        d = self.drafter(drafter, **drafter_kw) if drafter else None
        return Engine(verifier, self.itemset, self.cfg.max_history, d)

    # -- persistence -------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta)
        recorded, data = self.meta.get("data_path"), self.data_path
        if (self.path is not None and recorded not in (None, "synthetic") and not Path(recorded).is_absolute()
                and Path(str(data)).is_dir()):  # a loaded bundle's relative path: relative to where it is saved now
            meta["data_path"] = _relative(str(data), path)
        meta.update(
            format_version=FORMAT_VERSION,
            name=self.name,
            model=self.cfg.model_dump(),
            sid={"n_levels": self.semantic_ids.n_levels, "codebook_size": self.semantic_ids.codebook_size,
                 "collision_size": self.semantic_ids.collision_size},
            n_items=len(self.catalogue),
        )
        if self.retrieval is not None:
            meta["retrieval"] = self.retrieval.cfg.model_dump()
            save_weights(self.retrieval, path / "retrieval.safetensors")
        if self.self_draft is not None:
            meta["self_draft"] = self.self_draft.cfg.model_dump()
            save_weights(self.self_draft, path / "self_draft.safetensors")
        if self.nezha_head is not None:
            meta["nezha_head"] = self.nezha_head.cfg.model_dump()
            save_weights(self.nezha_head, path / "nezha_head.safetensors")
        if self.sid_mlp is not None:
            meta["sid_mlp"] = self.sid_mlp.cfg.model_dump()
            save_weights(self.sid_mlp, path / "sid_mlp.safetensors")
        if self.sasrec is not None:
            meta["sasrec"] = self.sasrec.cfg.model_dump()
            save_weights(self.sasrec, path / "sasrec.safetensors")
        if self.text_emb is not None:  # a new file: bundles of one catalogue may share it by a link, never written to
            emb = path / "text_emb.npy"
            emb.unlink(missing_ok=True)
            np.save(emb, self.text_emb.astype(np.float16))
        (path / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
        with open(path / "items.jsonl", "w", encoding="utf-8") as fh:
            c = self.catalogue
            for i in range(len(c)):
                fh.write(json.dumps({"item_id": c.ids[i], "title": c.titles[i], "text": c.texts[i],
                                     "sid": [int(x) for x in self.sids[i]], "seen": bool(self.seen[i])}) + "\n")
        np.save(path / "codebooks.npy", self.semantic_ids.codebooks)
        save_weights(self.model, path / "model.safetensors")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Bundle:
        path = Path(path)
        meta = read_meta(path)
        ids, titles, texts, sids, seen = [], [], [], [], []
        with open(path / "items.jsonl", encoding="utf-8") as fh:
            for line in fh:
                o = json.loads(line)
                ids.append(o["item_id"])
                titles.append(o["title"])
                texts.append(o["text"])
                sids.append(o["sid"])
                seen.append(o["seen"])
        model = load_weights(Tiger(TigerConfig(**meta["model"])), path / "model.safetensors")
        sem = SemanticIds(np.load(path / "codebooks.npy"), meta["sid"]["collision_size"])
        b = cls(name=meta["name"], catalogue=Catalogue(ids, titles, texts), semantic_ids=sem,
                sids=np.asarray(sids, dtype=np.int64), seen=np.asarray(seen, dtype=bool), model=model, meta=meta,
                path=path)
        if (path / "text_emb.npy").exists():
            b.text_emb = np.load(path / "text_emb.npy").astype(np.float32)
        if "retrieval" in meta:
            b.retrieval = load_weights(
                RetrievalModel(RetrievalConfig(**meta["retrieval"])), path / "retrieval.safetensors"
            )
        if "self_draft" in meta:
            b.self_draft = load_weights(
                SelfDraftHead(model, SelfDraftConfig(**meta["self_draft"])), path / "self_draft.safetensors"
            )
        if "nezha_head" in meta:
            b.nezha_head = load_weights(
                NezhaHead(model, NezhaConfig(**meta["nezha_head"])), path / "nezha_head.safetensors"
            )
        if "sid_mlp" in meta:
            b.sid_mlp = load_weights(
                SidMlpDrafter(model.cfg.level_sizes, model.cfg.d_model, SidMlpConfig(**meta["sid_mlp"])),
                path / "sid_mlp.safetensors",
            )
        if "sasrec" in meta:
            b.sasrec = load_weights(SASRec(SASRecConfig(**meta["sasrec"])), path / "sasrec.safetensors")
        return b


def bundle_split(bundle: Bundle, data: str | Path | None = None, protocol: str | None = None) -> tuple[Dataset, Split]:
    """The dataset a bundle was trained on (or ``data``) and its split under ``protocol`` (default: the bundle's;
    a temporal split at the bundle's own cut-off), as evaluation and the benchmarks read it."""
    from .data.open import open_dataset
    from .data.splits import make_split, temporal

    where = ""
    if not data:
        data = bundle.data_path
        where = f" (the bundle's data_path {bundle.meta.get('data_path')!r}, from its directory {bundle.path})"
    if data and str(data) != "synthetic" and not Path(data).is_dir():
        raise SystemExit(f"dataset directory not found: {data}{where}; the bundle was trained on it: point --data at "
                         "a copy, e.g. data/beauty")
    ds = open_dataset(data)
    if ds.catalogue.ids != bundle.catalogue.ids:
        raise SystemExit(f"the dataset at {data} does not have the bundle's catalogue")
    protocol = protocol or bundle.meta.get("protocol", "loo")
    if protocol == "temporal" and bundle.meta.get("cutoff") is not None:
        return ds, temporal(ds, bundle.cfg.max_history, cutoff=int(bundle.meta["cutoff"]))
    return ds, make_split(ds, protocol, bundle.cfg.max_history, bundle.meta.get("quantile") or 0.8)
