"""Distilling the SID-MLP drafter (:mod:`specrec.models.sid_mlp`) from the target.

What verification needs is that the drafter's beams hold the target's
*frontier*: the prefixes the target's own beam search keeps after every level.
So the training data is the target's beam search itself, the serving search
(:func:`specrec.decoding.searches.beam.search`, read by :func:`target_frontier`),
computed once per model and cached (:func:`teacher_frontier`): for each training history, the
BOS state ``h0`` and, at every level j >= 1, the width-W beams the target kept
after level j-1 with the target's full next-level distribution there. The
drafter learns KL(p || q) at those prefixes (:func:`distill_loss`), optionally
plus the same at the prefixes the drafter itself keeps (:func:`own_prefixes`:
a second teacher pass over the drafter's beams, so that it also learns where
it goes wrong).

Model selection is by frontier coverage on a fixed random sample of
validation histories (:func:`frontier_coverage`): per level, the share of the
target's width-K frontier that the drafter's N beams contain, and the share of
requests where every level is covered (no fallback).

``DistillConfig.device`` runs all of it on a GPU (:mod:`specrec.train.device`): the
target's frontier, the drafter's training and its selection, in float32; the
cached frontier and the drafter come back on the CPU.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, Field

from ..data.splits import Examples, Split, sample_examples
from ..decoding.searches import SearchState
from ..decoding.searches import beam as beam_search
from ..ids.tables import Level
from ..ids.trie import SidTrie
from ..models.hotpath import FusedHotPath
from ..models.sid_mlp import SidMlpConfig, SidMlpDrafter
from ..models.tiger import Tiger
from ..terminal import progress_bar
from .batches import history_batch
from .device import on_device, resolve_device, to_device

#: histories per call of the target's search when reading its frontier on the CPU: the serving search's ancestor
#: gathers stay in the CPU's caches at 64 rows x 32 beams (about 14 ms a history against 26 at 256, rough, 2 shared
#: cores); on a GPU the batch it had, 256 (not measured against others there)
FRONTIER_BATCH = {"cpu": 64, "other": 256}


def frontier_batch(device: torch.device) -> int:
    """Histories per call of the target's search on ``device`` (:data:`FRONTIER_BATCH`)."""
    return FRONTIER_BATCH["cpu" if device.type == "cpu" else "other"]


class DistillConfig(BaseModel):
    examples: int = Field(default=60_000, ge=100, description="training histories whose target frontier is cached")
    valid_examples: int = Field(default=2000, ge=100, description="validation histories for model selection")
    width: int = Field(default=32, ge=1, le=256, description="target beam width whose frontier is distilled")
    epochs: int = Field(default=6, ge=1, le=1000)
    batch_size: int = Field(default=256, ge=1)
    lr: float = Field(default=2e-3, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    own_weight: float = Field(default=0.5, ge=0, description="weight of the KL at the drafter's own prefixes (0: off)")
    own_from: int = Field(default=2, ge=1, description="epochs on the target's prefixes before the drafter's own join")
    own_examples: int = Field(
        default=12_000, ge=1, description="training histories whose drafter prefixes are verified"
    )
    keep_top: int = Field(default=10, ge=1, description="per step, KL at the target's best this many kept prefixes ...")
    sample_rest: int = Field(
        default=10, ge=0, description="... and at this many others of its frontier, drawn at random"
    )
    select_k: int = Field(default=10, ge=1, description="frontier width K used for model selection")
    select_n: int = Field(default=20, ge=1, description="drafter beams N per level used for model selection")
    seed: int = 0
    device: str = Field(default="cpu", description="where the frontier is computed and the drafter trains")


@dataclass
class Frontier:
    """The target's beams of some histories: ``h0`` [N, d]; ``root`` [N, V_0] level 0's log-probs; per level
    j = 1..L-1 the prefixes it kept ``codes[j-1]`` [N, W, j], ``alive[j-1]`` [N, W] and its next-level
    log-probs there ``logp[j-1]`` [N, W, V_j]."""

    h0: np.ndarray
    root: np.ndarray
    codes: list[np.ndarray]
    alive: list[np.ndarray]
    logp: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.h0)

    def take(self, idx) -> Frontier:
        return Frontier(self.h0[idx], self.root[idx], [c[idx] for c in self.codes], [a[idx] for a in self.alive],
                        [p[idx] for p in self.logp])

    def save(self, path: Path) -> None:
        arrays = {"h0": self.h0, "root": self.root}
        for j in range(len(self.codes)):
            arrays.update({f"codes{j}": self.codes[j], f"alive{j}": self.alive[j], f"logp{j}": self.logp[j]})
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Frontier:
        z = np.load(path)
        n = sum(1 for k in z.files if k.startswith("codes"))
        return cls(z["h0"], z["root"], [z[f"codes{j}"] for j in range(n)], [z[f"alive{j}"] for j in range(n)],
                   [z[f"logp{j}"] for j in range(n)])


@torch.inference_mode()
def target_frontier(fused: FusedHotPath, tables: list[Level], hist_sids: torch.Tensor, width: int,
                    keep_logp: bool = True):
    """The target's constrained beam search on [R, H, L] histories, the serving search itself
    (:func:`specrec.decoding.searches.beam.search`), keeping what distillation reads: (h0 [R, d], root log-probs
    [R, V0], per level j >= 1 (prefixes [R, W, j], alive [R, W], log-probs [R, W, V_j]; None without
    ``keep_logp``), the final state)."""
    keep, ck, cv = fused.encode(hist_sids)
    sizes = fused.cfg.level_sizes
    seen: list = []

    def watch(level: int, state: SearchState, hid: torch.Tensor, logp: torch.Tensor) -> None:
        if level == 0:
            seen.append((hid[:, 0], logp[:, 0, : sizes[0]]))
        else:
            seen.append((state.codes, state.nodes >= 0, logp[..., : sizes[level]] if keep_logp else None))

    state = beam_search.search(fused, fused.cross(keep, ck, cv), tables, width, watch)
    (h0, root), levels = seen[0], seen[1:]
    return h0, root, levels, state


def _key(gr: Tiger, ex: Examples, sids: np.ndarray, width: int) -> str:
    h = hashlib.sha256()
    for t in (ex.history, np.asarray(sids)):
        h.update(np.ascontiguousarray(t).tobytes())
    for v in gr.state_dict().values():
        h.update(v.detach().float().cpu().numpy().tobytes())
    h.update(str(width).encode())
    return h.hexdigest()[:16]


def teacher_frontier(gr: Tiger, ex: Examples, sids: np.ndarray, trie: SidTrie, width: int, cache: Path | None = None,
                     batch_size: int | None = None, progress: bool = True) -> Frontier:
    """:func:`target_frontier` over every example, in batches (:func:`frontier_batch`), on ``gr``'s device, cached
    on disk by content."""
    path = None if cache is None else cache / f"frontier_w{width}_{_key(gr, ex, sids, width)}.npz"
    if path is not None and path.exists():
        return Frontier.load(path)
    fused = FusedHotPath(gr).eval()
    dev = fused.tok.device
    tables = [lv.to(dev) for lv in trie.search_tables(fused.vmax)]
    sids_t = torch.from_numpy(np.ascontiguousarray(sids, dtype=np.int64)).to(dev)
    batch_size = batch_size or frontier_batch(dev)
    parts: list = []
    for s in progress_bar(range(0, len(ex), batch_size), desc=f"target frontier (width {width})",
                          disable=not progress, leave=False):
        h0, root, levels, _ = target_frontier(fused, tables, history_batch(sids_t, ex.history[s : s + batch_size]),
                                              width)
        parts.append((h0.cpu().numpy().astype(np.float16), root.cpu().numpy().astype(np.float16),
                      [(c.cpu().numpy().astype(np.uint8 if max(trie.level_sizes) <= 256 else np.int32),
                        a.cpu().numpy(), p.cpu().numpy().astype(np.float16)) for c, a, p in levels]))
    n_lv = len(parts[0][2])
    out = Frontier(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                   [cat_padded([p[2][j][0] for p in parts]) for j in range(n_lv)],
                   [cat_padded([p[2][j][1] for p in parts]) for j in range(n_lv)],
                   [cat_padded([p[2][j][2] for p in parts], fill=-np.inf) for j in range(n_lv)])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        out.save(path)
    return out


def cat_padded(xs: list[np.ndarray], fill=0) -> np.ndarray:
    """Concatenate along axis 0, padding axis 1 (beams: a batch of short catalogues may keep fewer) to the widest."""
    w = max(x.shape[1] for x in xs)
    out = []
    for x in xs:
        if x.shape[1] < w:
            pad = np.full((x.shape[0], w - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype)
            x = np.concatenate([x, pad], 1)
        out.append(x)
    return np.concatenate(out)


def distill_loss(drafter: SidMlpDrafter, h0: torch.Tensor, codes: list[torch.Tensor], alive: list[torch.Tensor],
                 logp: list[torch.Tensor]) -> torch.Tensor:
    """KL(p || q) at every kept prefix of every level, mean over alive prefixes, summed over levels."""
    total = h0.new_zeros(())
    for c, a, lp in zip(codes, alive, logp):
        lq = drafter.level_logprobs(h0, c.long())
        p = lp.float().exp()
        kl = (p * (lp.float().clamp(min=-1e4) - lq)).sum(-1)
        w = a.float()
        total = total + (kl * w).sum() / w.sum().clamp(min=1)
    return total


@torch.no_grad()
def drafter_beams(drafter: SidMlpDrafter, h0: torch.Tensor, root: torch.Tensor, tables: list[Level],
                  widths: list[int]) -> list[torch.Tensor]:
    """The drafter's constrained beams: level 0 exact (the target's ``root`` log-probs), then the drafter's
    levels; ``widths[j]`` beams kept after level j. Returns each level's kept prefixes [R, widths[j], j+1]
    (dead beams -1)."""
    r = h0.shape[0]
    state = SearchState.root(r, h0.device)
    vmax = max(drafter.level_sizes)
    out = []
    for level, w in enumerate(widths):
        if level == 0:
            logp = torch.nn.functional.pad(root.float(), (0, vmax - root.shape[-1]), value=float("-inf")).unsqueeze(1)
        else:
            lq = drafter.level_logprobs(h0.float(), state.codes.clamp(min=0))
            logp = torch.nn.functional.pad(lq, (0, vmax - lq.shape[-1]), value=float("-inf"))
        state, _ = state.advance(logp, tables[level], w)
        out.append(torch.where((state.nodes >= 0).unsqueeze(-1), state.codes, -1))
    return out


def _keys(codes: np.ndarray, sizes: list[int]) -> np.ndarray:
    k = np.zeros(codes.shape[:-1], dtype=np.int64)
    for j in range(codes.shape[-1]):
        k = k * sizes[j] + codes[..., j]
    return np.where((codes < 0).any(-1), -1, k)


def frontier_coverage(drafted: list[np.ndarray], target: list[np.ndarray], target_alive: list[np.ndarray],
                      sizes: list[int]) -> dict:
    """Per level (prefix lengths 1..len(target)): mean share of the target's kept prefixes among the drafted ones,
    and the share of requests whose every level is covered."""
    per_level: list[float] = []
    whole = np.ones(len(drafted[0]), dtype=bool)
    for d, t, a in zip(drafted, target, target_alive):
        dk, tk = _keys(np.asarray(d), sizes), _keys(np.asarray(t), sizes)
        hit = (tk[:, :, None] == dk[:, None, :]).any(-1) | ~a
        n = np.maximum(a.sum(1), 1)
        per_level.append(float(((hit & a).sum(1) / n).mean()))
        ok = hit.all(1)
        whole &= ok
    return {"levels": per_level, "mean": float(np.mean(per_level)), "whole": float(np.mean(whole))}


def coverage_report(drafter: SidMlpDrafter, fused: FusedHotPath, tables, sids_t: torch.Tensor, ex: Examples,
                    k: int, ns: list[int], batch_size: int | None = None) -> dict:
    """Frontier coverage of the target's width-``k`` beams by the drafter's ``n`` beams, for each n in ``ns``
    (level 1 exact: the target's top-k), on examples ``ex``."""
    sizes = fused.cfg.level_sizes
    L = len(sizes)
    res: dict = {}
    drafted: dict = {n: [[] for _ in range(L - 1)] for n in ns}
    target: list = [[] for _ in range(L - 1)]
    alive: list = [[] for _ in range(L - 1)]
    batch_size = batch_size or frontier_batch(sids_t.device)
    for s in range(0, len(ex), batch_size):
        h0, root, levels, _ = target_frontier(fused, tables, history_batch(sids_t, ex.history[s : s + batch_size]), k,
                                              keep_logp=False)
        for j, (c, a, _) in enumerate(levels):  # the target's kept prefixes after levels 0..L-2 (lengths 1..L-1)
            target[j].append(c.cpu().numpy())
            alive[j].append(a.cpu().numpy())
        for n in ns:
            beams = drafter_beams(drafter, h0, root, tables, [k] + [n] * (L - 2))
            for j in range(L - 1):
                drafted[n][j].append(beams[j].cpu().numpy())
    for n in ns:
        res[n] = frontier_coverage([cat_padded(d, fill=-1) for d in drafted[n]], [cat_padded(t) for t in target],
                                   [cat_padded(a, fill=False) for a in alive], sizes)
    return res


def own_prefixes(drafter: SidMlpDrafter, fused: FusedHotPath, tables, sids_t: torch.Tensor, ex: Examples,
                 fr: Frontier, n: int, batch_size: int = 256, progress: bool = True) -> Frontier:
    """The drafter's own kept prefixes (width ``n``, level 0 exact) on ``ex``, with the target's next-level
    distributions there (one tree pass per batch): a second frontier to learn from."""
    from ..decoding.tree import build_tree, read_level

    sizes = fused.cfg.level_sizes
    L = len(sizes)
    dev = sids_t.device
    codes_l: list = [[] for _ in range(L - 1)]
    alive_l: list = [[] for _ in range(L - 1)]
    logp_l: list = [[] for _ in range(L - 1)]
    for s in progress_bar(range(0, len(ex), batch_size), desc="drafter's own prefixes", disable=not progress,
                          leave=False):
        sl = slice(s, s + batch_size)
        h0 = to_device(fr.h0[sl], dev).float()
        root = to_device(fr.root[sl], dev).float()
        beams = [b.cpu() for b in drafter_beams(drafter, h0, root, tables, [n] * (L - 1))]
        hist = history_batch(sids_t, ex.history[sl])
        with torch.inference_mode():
            keep, ck, cv = fused.encode(hist)
            full = beams[-1].numpy()
            tree = build_tree([(full, np.asarray((full >= 0).all(-1)))], sizes, len(h0))
            out = fused.tree(tree.tokens.to(dev), tree.positions.to(dev), tree.mask.to(dev), keep, ck, cv).cpu()
        for j in range(L - 1):
            c = beams[j].numpy()
            a = (c >= 0).all(-1)
            lp = read_level(out, tree.lookup(np.maximum(c, 0)), j + 1, sizes)
            codes_l[j].append(np.maximum(c, 0).astype(fr.codes[j].dtype))
            alive_l[j].append(a)
            logp_l[j].append(lp.numpy().astype(np.float16))
    return Frontier(fr.h0, fr.root, [np.concatenate(c) for c in codes_l], [np.concatenate(a) for a in alive_l],
                    [np.concatenate(p) for p in logp_l])


def train_sid_mlp(gr: Tiger, split: Split, sids: np.ndarray, cfg: DistillConfig | None = None,
                  mcfg: SidMlpConfig | None = None, cache: Path | None = None, log: Callable[[str], None] = print,
                  progress: bool = True, minutes: float | None = None) -> tuple[SidMlpDrafter, dict]:
    """Distil a :class:`SidMlpDrafter` from the frozen target ``gr``; keep the epoch with the best whole-frontier
    coverage on a fixed random sample of validation histories. ``minutes`` caps the training time. On
    ``cfg.device``; ``gr`` stays where it was, the drafter comes back on the CPU."""
    cfg = cfg or DistillConfig()
    with on_device(gr, resolve_device(cfg.device)):
        drafter, rep = _distill(gr, split, sids, cfg, mcfg, cache, log, progress, minutes)
    return drafter.cpu().eval(), rep


def _distill(gr: Tiger, split: Split, sids: np.ndarray, cfg: DistillConfig, mcfg: SidMlpConfig | None,
             cache: Path | None, log: Callable[[str], None], progress: bool,
             minutes: float | None) -> tuple[SidMlpDrafter, dict]:
    torch.manual_seed(cfg.seed)
    gr.eval()
    t_start = time.time()
    dev = next(gr.parameters()).device
    trie = SidTrie(sids, gr.cfg.level_sizes)
    fused = FusedHotPath(gr).eval()
    tables = [lv.to(dev) for lv in trie.search_tables(fused.vmax)]
    sids_t = torch.from_numpy(np.ascontiguousarray(sids, dtype=np.int64)).to(dev)
    train_ex = sample_examples(split.train, cfg.examples, cfg.seed)
    valid_ex = sample_examples(split.valid, cfg.valid_examples, cfg.seed + 1)
    fr = teacher_frontier(gr, train_ex, sids, trie, cfg.width, cache, progress=progress)
    log(f"target frontier of {len(fr)} training histories (width {cfg.width}) in {time.time() - t_start:.0f} s")
    drafter = SidMlpDrafter(gr.cfg.level_sizes, gr.cfg.d_model, mcfg).to(dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = -(-len(fr) // cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total, pct_start=0.05)

    def select() -> dict:
        drafter.eval()
        rep = coverage_report(drafter, fused, tables, sids_t, valid_ex, cfg.select_k, [cfg.select_n])[cfg.select_n]
        drafter.train()
        return rep

    best, history = -1.0, []
    acc = torch.zeros((), dtype=torch.float64, device=dev)  # the epoch's loss sum (float64: as Python floats')
    best_state = {k: v.clone() for k, v in drafter.state_dict().items()}
    own: Frontier | None = None
    own_rows = np.sort(
        np.random.default_rng(cfg.seed + 2).choice(len(fr), min(cfg.own_examples, len(fr)), replace=False)
    )

    def batch_loss(f: Frontier, idx: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
        w = f.codes[0].shape[1]
        rest = np.arange(min(cfg.keep_top, w), w)
        cols = np.concatenate(
            [np.arange(min(cfg.keep_top, w)), np.sort(rng.choice(rest, min(cfg.sample_rest, len(rest)), replace=False))]
        )
        return distill_loss(drafter, to_device(f.h0[idx], dev).float(),  # pinned copies, not waited for
                            [to_device(c[idx][:, cols], dev) for c in f.codes],
                            [to_device(a[idx][:, cols], dev) for a in f.alive],
                            [to_device(p[idx][:, cols], dev) for p in f.logp])

    for epoch in range(cfg.epochs):
        t0 = time.time()
        if cfg.own_weight > 0 and epoch == cfg.own_from:  # once: where the drafter's own beams go, verified
            drafter.eval()
            own = own_prefixes(drafter, fused, tables, sids_t, train_ex.take(own_rows), fr.take(own_rows),
                               cfg.select_n * 2, progress=progress)
            drafter.train()
            log(f"verified the drafter's own prefixes on {len(own_rows)} histories in {time.time() - t0:.0f} s")
        rng = np.random.default_rng(cfg.seed * 7919 + epoch)
        order = rng.permutation(len(fr))
        acc.zero_()
        for step, s in enumerate(progress_bar(range(0, len(order), cfg.batch_size),
                                              desc=f"distil {epoch + 1}/{cfg.epochs}", disable=not progress,
                                              leave=False)):
            idx = np.sort(order[s : s + cfg.batch_size])
            loss = batch_loss(fr, idx, rng)
            if own is not None:
                loss = loss + cfg.own_weight * batch_loss(own, np.sort(rng.choice(len(own), len(idx) // 2)), rng)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc += loss.detach().double() * len(idx)
            if not progress and step % 50 == 49:
                log(f"  epoch {epoch + 1} step {step + 1}/{steps_per_epoch}: loss {float(acc) / (s + len(idx)):.4f}")
        rep, tot = select(), float(acc)
        history.append({"epoch": epoch + 1, "loss": tot / len(fr), "valid_coverage": rep,
                        "seconds": round(time.time() - t0, 1)})
        log(f"distil epoch {epoch + 1}: loss {tot / len(fr):.4f}  valid coverage per level "
            f"{[round(x, 3) for x in rep['levels']]}  whole frontier {rep['whole']:.3f}")
        if rep["whole"] > best:
            best, best_state = rep["whole"], {k: v.clone() for k, v in drafter.state_dict().items()}
        if minutes is not None and time.time() - t_start > minutes * 60:
            log(f"stopping after {epoch + 1} epochs: the {minutes} minute cap")
            break
    drafter.load_state_dict(best_state)
    return drafter.eval(), {"config": cfg.model_dump(), "device": str(dev), "model": drafter.cfg.model_dump(),
                            "params": drafter.n_params(), "best_valid_whole_frontier": best,
                            "select": {"k": cfg.select_k, "n": cfg.select_n}, "epochs": history,
                            "minutes": round((time.time() - t_start) / 60, 1)}
