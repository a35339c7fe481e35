"""The eager backend, and what every backend shares.

A backend runs the four hot-path functions of :mod:`specrec.models.hotpath`
and hands decoding its tensors on decoding's terms:

- :meth:`Backend.encode` -> :class:`~specrec.models.tiger.EncoderState`;
- :meth:`Backend.step` -> next-level log-probs of a beam step, and the cache;
- :meth:`Backend.tree` -> every node's next-level log-probs of a prefix tree;
- :meth:`Backend.head_hidden` -> the NEZHA head's decoder states.

Histories are trimmed to the real items rounded up to a multiple of 4 (left
padding changes nothing: padded positions are masked, and positions count from
the oldest real item or from the right), which more than halves the encoder's
work on Beauty. A backend that compiles for fixed shapes also pads requests,
beams and tree nodes to buckets (:meth:`Backend.padded`); the eager backend
pads nothing.

The eager backend runs :class:`~specrec.models.hotpath.FusedHotPath` in torch:
the same functions, the same decoder step, and the same whole searches of the
registry (:data:`specrec.decoding.searches.SEARCHES`) that the graph backends
export, so a graph backend's test against it checks the export, and the fused
functions are themselves checked against the model
(:class:`~specrec.models.tiger.Tiger`, ``tests/unit/test_hotpath.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..decoding.beam import StepCache
from ..decoding.searches import SEARCHES
from ..decoding.tree import PrefixTree
from ..ids.tables import Level
from ..models.hotpath import FusedHotPath
from ..models.tiger import EncoderState, Tiger

DRAFT_FACTORS = (1, 1.5, 2, 3, 4, 6)  # draft counts are m * K for m here (see policies.draft_sizer.DraftSizer)


def draft_count(factor: float, k: int) -> int:
    return int(-(-factor * k // 1))


def history_bucket(n: int, window: int) -> int:
    """History positions kept: the real ones rounded up to a multiple of 4 (at most the window)."""
    return min(window, max(4, -(-n // 4) * 4))


def _pad(x: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to size ``n`` by repeating its first slice."""
    have = x.shape[dim]
    if have >= n:
        return x
    first = x.narrow(dim, 0, 1)
    reps = [1] * x.dim()
    reps[dim] = n - have
    return torch.cat([x, first.repeat(*reps)], dim=dim)


class Backend:
    """Eager PyTorch (the fused hot path in torch): what every other backend is tested against."""

    name: ClassVar[str] = "eager"
    graphs: ClassVar[bool] = False  # the registry's functions in torch; a search's ``eager`` replaces its own

    def __init__(self, model: Tiger, head=None, device: str = "cpu", drafter=None):
        """``device``: where the eager backend computes ("cuda" for a GPU; the
        decoding around it stays on the CPU, tensors cross at the four calls).
        ``drafter``: the distilled drafter (:class:`~specrec.models.sid_mlp.SidMlpDrafter`), for
        the searches that run it. Whole searches are one call, :meth:`search`, by the registry's names
        (:data:`~specrec.decoding.searches.SEARCHES`)."""
        self.device = torch.device(device)
        self.model = model.eval()
        self.cfg = model.cfg
        self.nezha_head = head
        self.drafter = drafter
        self.placeholders = None if head is None else head.placeholders.detach().to(self.device)
        self._fused: FusedHotPath | None = None

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device)}

    def _to(self, *xs):
        return [x.to(self.device) for x in xs] if self.device.type != "cpu" else list(xs)

    def _back(self, x):
        return x.cpu() if self.device.type != "cpu" else x

    @property
    def fused(self) -> FusedHotPath:
        """The hot path's functions in torch, on this backend's device (made on first use)."""
        if self._fused is None:
            self._fused = FusedHotPath(self.model, self.nezha_head, self.drafter).eval().to(self.device)
        return self._fused

    # -- the four functions (subclasses replace these) -----------------------------
    # The encoder state keeps the model's layout (keys [n_layers, R, h, S, dk], as :meth:`Tiger.encode`'s), so
    # the model's own decoder reads it too (training does); the fused functions take the keys transposed.
    def _encode(self, hist_sids):
        keep, cross_k, cross_v = self.fused.encode(*self._to(hist_sids))
        return keep, cross_k.transpose(-1, -2), cross_v  # the state stays on the device

    def _step(self, tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v):
        logp, k, v = self.fused.step(*self._to(tokens, start, parent, enc_mask, cross_k.transpose(-1, -2), cross_v,
                                               cache_k, cache_v))
        return self._back(logp), k, v  # the cache stays on the device

    def _tree(self, tokens, positions, tree_mask, enc_mask, cross_k, cross_v):
        return self._back(self.fused.tree(*self._to(tokens, positions, tree_mask, enc_mask,
                                                    cross_k.transpose(-1, -2), cross_v)))

    def _head_hidden(self, enc_mask, cross_k, cross_v, placeholders):
        return self._back(self.fused.head_hidden(*self._to(enc_mask, cross_k.transpose(-1, -2), cross_v, placeholders)))

    def _empty_cache(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fused.empty_cache(rows)

    # -- whole searches: one entry point, the registry's names -------------------------------------------
    def search(self, name: str, enc: EncoderState, trie, widths: tuple[int, ...] = (),
               args: dict[str, torch.Tensor] | None = None) -> Any:
        """Whole search ``name`` of the registry (:data:`~specrec.decoding.searches.SEARCHES`) over ``trie``'s
        valid SIDs, of static ``widths`` (in the order the search names them), on the caller's ``args`` -> its
        value (beams, ``strict``'s :class:`~specrec.decoding.searches.Drafted`, ``rank``'s token
        log-probabilities), or None where this backend cannot run it (no NEZHA head or distilled drafter; the
        eager backend's target beam search, which the verifier steps)."""
        s = SEARCHES[name]
        if (s.uses_head and self.nezha_head is None) or (s.uses_sid_drafter and self.drafter is None):
            return None
        if not self.graphs and s.eager is not None:
            return s.eager(self, enc, trie, *widths)
        return s.run(self._run_search, enc, trie, tuple(widths), dict(args or {}))

    def _run_search(self, name: str, enc: EncoderState, trie, widths: tuple[int, ...],
                    inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """One search's function (its ``inputs`` after the tables) -> its outputs. Eager: the registry's
        function itself, in torch (what the graph backends export)."""
        s = SEARCHES[name]
        tables = self._tables(trie) if s.tables else []
        enc_mask, cross_k, cross_v = self._to(*self._fused_encoder(enc))
        with torch.inference_mode():
            out = s.fn(self.fused, enc_mask, cross_k, cross_v, tables, *widths, *self._to(*inputs))
        return [self._back(x) for x in out]

    def _tables(self, trie) -> list[Level]:
        """The trie's search tables (:meth:`~specrec.ids.trie.SidTrie.search_tables`, kept by the trie; a request's
        view: its catalogue's, with its cut lists) on this backend's device."""
        tables = trie.search_tables(max(self.cfg.level_sizes))
        return tables if self.device.type == "cpu" else [lv.to(self.device) for lv in tables]

    def _fused_encoder(self, enc: EncoderState):
        """The encoder state in the fused functions' layout (mask [R, S], keys transposed)."""
        return enc.keep.reshape(enc.n, -1), enc.cross_k.transpose(-1, -2), enc.cross_v

    def warmup(self, trie, ks=(10,), drafts=DRAFT_FACTORS, scored: tuple[int, ...] = ()) -> None:
        """Prepare what serving list lengths ``ks`` will use (nothing to prepare eagerly)."""

    def warm_calls(self, ks, drafts) -> list[tuple[str, tuple[int, ...]]]:
        """Every (search, widths) serving list lengths ``ks`` uses, as the registry's searches say (their
        ``warm``, with the draft counts ``m * K`` for m in ``drafts``), that this backend can run."""
        calls = []
        for s in SEARCHES.values():
            outer = SEARCHES[s.inside] if s.inside else s
            if ((outer.uses_head and self.nezha_head is None) or (outer.uses_sid_drafter and self.drafter is None)
                    or self.cfg.sid_len < s.min_levels):
                continue
            for k in ks:
                calls += [(s.name, w) for w in s.warm(k, [draft_count(m, k) for m in drafts])]
        return list(dict.fromkeys(calls))

    def padded(self, kind: str, n: int) -> int:
        """Size to pad a varying axis to: ``kind`` is 'requests', 'beams' or 'nodes'."""
        return n

    # -- decoding-side calls -----------------------------------------------------------
    def _enc_inputs(self, enc: EncoderState, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _pad(enc.keep, rows), _pad(enc.cross_k, rows, 1), _pad(enc.cross_v, rows, 1)

    @torch.inference_mode()
    def encode(self, hist_sids: torch.Tensor) -> EncoderState:
        """[R, H, L] codes, left-padded with rows of -1 -> encoder state (trimmed to a history bucket)."""
        r, h, _ = hist_sids.shape
        real = int((hist_sids[:, :, 0] >= 0).sum(1).max())
        x = _pad(hist_sids[:, h - history_bucket(real, h) :], self.padded("requests", r))
        keep, ck, cv = self._encode(x)
        return EncoderState(None, self._back(keep[:r, None, None, :]), ck[:, :r], cv[:, :r])

    @torch.inference_mode()
    def step(self, enc: EncoderState, tokens: torch.Tensor, start: int, parent: torch.Tensor | None,
             cache: StepCache | None) -> tuple[torch.Tensor, StepCache]:
        """One cached beam step: ``tokens`` [R, B] at decoder position ``start``;
        ``parent`` [R*B] the beam (flat ``r * B_prev + j``) each beam continues,
        None at the first step. Returns level ``start``'s log-probs [R, B, V]
        and the new cache."""
        r, b = tokens.shape
        cfg = self.cfg
        rp, bp = self.padded("requests", r), self.padded("beams", b)
        if cache is None:
            cache = StepCache(*self._empty_cache(rp * bp), bp, b)
            rows = torch.arange(rp * bp)
        else:  # beam j of request q continues cache row q * row_width + (its parent's index within q)
            assert parent is not None  # every step after the first has parents
            q = torch.arange(r).view(-1, 1)
            rows = q * cache.row_width + (parent.view(r, b) - q * cache.beams)
            rows = _pad(_pad(rows, bp, 1), rp).reshape(-1)
        tokens = _pad(_pad(tokens, bp, 1), rp)
        logp, k, v = self._step(tokens, torch.tensor(start, dtype=torch.int64), rows,
                                *self._enc_inputs(enc, rp), cache.k, cache.v)
        v_level = cfg.level_sizes[start]
        return logp.view(rp, bp, -1)[:r, :b, :v_level], StepCache(k, v, bp, b)

    @torch.inference_mode()
    def tree(self, enc: EncoderState, tree: PrefixTree) -> torch.Tensor:
        """Every node's log-probs of every level [R, T, L, Vmax] (T = tree.width; read level = depth)."""
        r, t = tree.tokens.shape
        rp, tp = self.padded("requests", r), self.padded("nodes", t)
        tokens, positions, mask = tree.tokens, tree.positions, tree.mask
        if tp > t:  # padding nodes: PAD tokens that attend only to themselves
            tokens, positions = F.pad(tokens, (0, tp - t)), F.pad(positions, (0, tp - t))
            mask = F.pad(mask, (0, tp - t, 0, tp - t))
            mask[:, torch.arange(t, tp), torch.arange(t, tp)] = True
        out = self._tree(_pad(tokens, rp), _pad(positions, rp), _pad(mask, rp), *self._enc_inputs(enc, rp))
        return out[:r, :t]

    @torch.inference_mode()
    def head_hidden(self, enc: EncoderState) -> torch.Tensor:
        """The NEZHA head's decoder states [R, L, d]."""
        if self.placeholders is None:
            raise RuntimeError("this backend has no NEZHA draft head")
        r = enc.n
        return self._head_hidden(*self._enc_inputs(enc, self.padded("requests", r)), self.placeholders)[:r]
