"""A trained bundle: everything needed to serve or evaluate one model.

A bundle directory holds

- ``bundle.json``   name, dataset, protocol, model and SID config, training summary;
- ``items.jsonl``   per item: id, title, text, SID, seen flag (catalogue order);
- ``codebooks.npy`` RQ codebooks [L, C, D] for inductive SIDs of new items;
- ``model.safetensors`` the GR model's weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from .data.dataset import Catalogue
from .ids.semantic import SemanticIds
from .ids.trie import SidTrie
from .models.tiger import Tiger, TigerConfig

FORMAT_VERSION = 1


@dataclass
class Bundle:
    name: str
    catalogue: Catalogue
    semantic_ids: SemanticIds
    sids: np.ndarray  # [N, L] int64
    seen: np.ndarray  # [N] bool
    model: Tiger
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sids.shape != (len(self.catalogue), self.model.cfg.sid_len):
            raise ValueError(f"sids shape {self.sids.shape} does not match catalogue/model")
        self.model.eval()
        self.sids_t = torch.from_numpy(np.ascontiguousarray(self.sids, dtype=np.int64))

    @property
    def cfg(self) -> TigerConfig:
        return self.model.cfg

    @cached_property
    def trie(self) -> SidTrie:
        return SidTrie(self.sids, self.cfg.level_sizes)

    def history_sids(self, histories: list[np.ndarray] | np.ndarray) -> torch.Tensor:
        """Item-index histories (ragged lists, or [R, H] padded with -1) ->
        [R, max_history, L] codes, left-padded with -1 rows."""
        h = self.cfg.max_history
        out = torch.full((len(histories), h, self.cfg.sid_len), -1, dtype=torch.int64)
        for i, items in enumerate(histories):
            items = np.asarray(items, dtype=np.int64)
            items = items[items >= 0][-h:]
            if len(items):
                out[i, h - len(items) :] = self.sids_t[torch.from_numpy(items)]
        return out

    # -- persistence -------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta)
        meta.update(
            format_version=FORMAT_VERSION,
            name=self.name,
            model=self.cfg.model_dump(),
            sid={"n_levels": self.semantic_ids.n_levels, "codebook_size": self.semantic_ids.codebook_size,
                 "collision_size": self.semantic_ids.collision_size},
            n_items=len(self.catalogue),
        )
        (path / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
        with open(path / "items.jsonl", "w", encoding="utf-8") as fh:
            c = self.catalogue
            for i in range(len(c)):
                fh.write(json.dumps({"item_id": c.ids[i], "title": c.titles[i], "text": c.texts[i],
                                     "sid": [int(x) for x in self.sids[i]], "seen": bool(self.seen[i])}) + "\n")
        np.save(path / "codebooks.npy", self.semantic_ids.codebooks)
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Bundle":
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "bundle.json").exists():
            raise FileNotFoundError(f"not a bundle directory (no bundle.json): {path}")
        meta = json.loads((path / "bundle.json").read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: bundle format {meta.get('format_version')} != {FORMAT_VERSION}")
        ids, titles, texts, sids, seen = [], [], [], [], []
        with open(path / "items.jsonl", encoding="utf-8") as fh:
            for line in fh:
                o = json.loads(line)
                ids.append(o["item_id"]); titles.append(o["title"]); texts.append(o["text"])
                sids.append(o["sid"]); seen.append(o["seen"])
        cfg = TigerConfig(**meta["model"])
        model = Tiger(cfg)
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        sem = SemanticIds(np.load(path / "codebooks.npy"), meta["sid"]["collision_size"])
        return cls(
            name=meta["name"], catalogue=Catalogue(ids, titles, texts), semantic_ids=sem,
            sids=np.asarray(sids, dtype=np.int64), seen=np.asarray(seen, dtype=bool), model=model, meta=meta,
        )
