"""``cuda``: the GR model's hot path on a GPU, its whole searches captured as CUDA graphs.

On a GPU an eager pass is a few hundred small kernel launches from Python: eager beam search at K = 10 took
14 ms on an H200, slower than two CPU cores. Captured, the same search is one launch (``../shared/ANCHORS.md``).
So :class:`CudaBackend` runs on the device:

- ``encode`` and every whole search of the registry (:data:`~specrec.decoding.searches.SEARCHES`: ``beam``,
  ``head``, ``draft``, ``draft_scored``, ``strict`` and its ``resume``, ``rank``) as graphs captured per
  (search, widths, row bucket) by a :class:`~.graphs.GraphRunner`: histories padded to the model's window, rows
  to the smallest bucket of ``batch_sizes`` (larger calls run in chunks of the largest), ``rank``'s candidates to
  a multiple of 8 (then a power of two) and its nodes to the most those candidates can have;
- the item set's search tables (:mod:`specrec.ids.tables`: per level a dense child table or CSR arrays, O(items)
  at any size) in static buffers per level (:class:`DeviceTables`), which every graph reads: the catalogue is
  uploaded once per version, a request's view without some items (:meth:`~specrec.ids.trie.SidTrie.excluding`)
  writes only its short cut lists, and the graphs mask those pairs;
- the hot path's single functions (``step``, ``tree``, ``head_hidden``: the stepwise searches of ``specgr``,
  ``relaxed``, ``sample``) eagerly on the device, as does a search whose capture failed
  (:meth:`CudaBackend.describe` says which).

Lossless searches stay float32: TF32 is off (``torch.backends.*.allow_tf32``), so a captured search equals eager
torch on the same device, and the CPU's lists except where two scores tie within float32 rounding (the history
padded to the whole window changes the order of some sums).

Every device operation runs under the runner's lock: the graphs share one memory pool and the tables' buffers,
and a single GPU computes one batch at a time anyway; concurrent callers' jobs reach it batched (the verifier's
batcher), each batch padded to its bucket. A whole search holds the lock from its first graph to its value (``strict``
selects the rows its drafts missed on the device between its two graphs), so a capture, which holds it too, never
runs beside a search's device work.

``capture=False`` (the default off a GPU) is the stand-in CI tests on the CPU: the same buckets, padding, static
buffers, tables and chunks, the graphs' functions run eagerly over the static buffers.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..decoding.searches import SEARCHES
from ..ids.tables import NO_CUT, Level
from ..models.tiger import EncoderState
from .base import DRAFT_FACTORS, Backend
from .graphs import Feed, GraphRunner, bucket, chunks

#: row buckets captured by default: powers of two up to the verifier's default largest batch (vLLM captures 1, 2,
#: 4, then multiples of 8; powers of two keep the warm-up's ~36 graphs per bucket to about 250 in all)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: the hot path's functions that run eagerly on the device (the stepwise searches call them)
EAGER_FUNCTIONS = ("step", "tree", "head_hidden")


def candidate_bucket(m: int) -> int:
    """Candidates a ``rank`` graph is captured for: ``m`` rounded up to a multiple of 8, past 64 a power of two."""
    if m <= 64:
        return max(8, -(-m // 8) * 8)
    return 1 << (m - 1).bit_length()


def rank_buckets(scored: Sequence[int]) -> list[int]:
    """The candidate buckets the warm-up captures ``rank`` for: every one up to the largest of ``scored`` (the
    fused list's candidate counts; 8 at least), so a scoring call of fewer candidates finds its graph too."""
    top = candidate_bucket(max(scored, default=8))
    out, m = [], 8
    while m <= top:
        out.append(m)
        m = candidate_bucket(m + 1)
    return out


def lossless_float32() -> None:
    """No TF32 in matrix products or convolutions: float32 searches stay exact (``beam`` == eager == ``strict``)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class DeviceTables:
    """The item set's search tables (:mod:`specrec.ids.tables`) where the graphs read them: per level static
    buffers of ``capacity`` (the catalogue's sizes with headroom), filled with the tables of the catalogue a call
    searches, and its view's cut list. Padding keeps every read of a padded buffer what it was: a dense level's
    rows past the catalogue's are -1 (the last, which a dead beam reads, allows nothing), a CSR level's ``ptr``
    repeats its last offset (a dead beam's node -1 reads an empty range) and its ``codes`` are 0 past the edges
    (never read), its ``offs`` go on past the level's largest fan-out (edges past a node's range are masked), a cut
    list's pairs past the view's are (-2, 0), which match no node.

    A catalogue's tables go to the device once, when a call first searches it; a request's view without some
    items (:meth:`~specrec.ids.trie.SidTrie.excluding`) writes only its cut lists (a few pairs), so the tables never
    change per request. A catalogue that outgrows the buffers or has another form at a level, or a view that cuts
    more pairs than the cut buffers hold, gets new buffers (``generation`` + 1): the graphs that read the old
    ones must be captured again."""

    def __init__(self, device: torch.device, vmax: int, headroom: float = 1.25, round_to: int = 1024,
                 cuts: int = 32):
        self.device, self.vmax, self.headroom, self.round_to, self.cuts = device, vmax, headroom, round_to, cuts
        self.slots: list[Level] = []
        self.generation = 0
        self._holds: Callable[[], object] = lambda: None  # the trie whose tables and cuts the slots hold (weak)
        self._catalogue: Callable[[], object] = lambda: None  # the catalogue whose tables the slots hold (weak)

    def load(self, trie) -> list[Level]:
        """The slots, holding ``trie``'s tables (a view's: its catalogue's, and its cut lists)."""
        if self._holds() is trie:
            return self.slots
        catalogue = getattr(trie, "base", trie)  # an ExcludingTrie's catalogue
        levels = trie.search_tables(self.vmax)
        if self._fit(levels):
            self._catalogue = lambda: None
        if self._catalogue() is not catalogue:
            for slot, lv in zip(self.slots, levels):
                _fill(slot.table, lv.table, -1)
                if lv.ptr is not None:
                    assert slot.ptr is not None and lv.codes is not None
                    _fill(slot.ptr, lv.ptr, int(lv.ptr[-1]))
                    _fill(slot.codes, lv.codes, 0)
            self._catalogue = weakref.ref(catalogue)
        for slot, lv in zip(self.slots, levels):
            slot.cut[0, lv.cut.shape[1] :].fill_(NO_CUT[0])
            slot.cut[1, lv.cut.shape[1] :].fill_(NO_CUT[1])
            slot.cut[:, : lv.cut.shape[1]].copy_(lv.cut)
        self._holds = weakref.ref(trie)
        return self.slots

    def _fit(self, levels: list[Level]) -> bool:
        """New buffers where ``levels`` do not fit the slots (-> True: the slots hold nothing yet)."""
        fits = len(self.slots) == len(levels) and all(
            s.dense == lv.dense and s.cut.shape[1] >= lv.cut.shape[1]
            and all(b.shape[0] >= t.shape[0] for b, t in zip(s.tensors()[:-1], lv.tensors()[:-1]))
            for s, lv in zip(self.slots, levels))
        if fits:
            return False
        dev = self.device

        def cap(n: int) -> int:
            return max(n, -(-int(n * self.headroom) // self.round_to) * self.round_to)

        def cut(c: int) -> torch.Tensor:
            return torch.zeros(2, max(self.cuts, 1 << (c - 1).bit_length()), dtype=torch.int64, device=dev)

        def slot(lv: Level) -> Level:
            if lv.table is not None:
                table = torch.full((cap(lv.table.shape[0]), self.vmax), -1, dtype=torch.int32, device=dev)
                return Level(table, None, None, None, cut(lv.cut.shape[1]))
            assert lv.ptr is not None and lv.codes is not None and lv.offs is not None
            return Level(None, torch.zeros(cap(lv.ptr.shape[0] - 1) + 1, dtype=torch.int32, device=dev),
                         torch.zeros(cap(lv.codes.shape[0]), dtype=torch.int32, device=dev),
                         torch.arange(lv.offs.shape[0], dtype=torch.int32, device=dev), cut(lv.cut.shape[1]))

        self.slots = [slot(lv) for lv in levels]
        self.generation += 1
        return True


def _fill(buf: torch.Tensor | None, x: torch.Tensor | None, rest) -> None:
    """``x`` into the first rows of static buffer ``buf``, ``rest`` into the others."""
    if buf is None or x is None:
        return
    buf[: x.shape[0]].copy_(x)
    buf[x.shape[0] :].fill_(rest)


def _search_fn(fn, fused, tables, widths, enc_mask, cross_k, cross_v, *inputs):
    """A registry search as a graph's function: the encoder state and inputs vary, the rest is static."""
    return fn(fused, enc_mask, cross_k, cross_v, tables, *widths, *inputs)


def _row_axis(name: str) -> int:
    return 1 if name == "kept_kv" else 0  # [n_layers, R, 1 + W, 2 * inner]; every other tensor leads with R


class CudaBackend(Backend):
    """The hot path as captured CUDA graphs (see the module's docstring); ``capture=False``: the CPU stand-in."""

    name = "cuda"
    graphs = True

    def __init__(self, model, head=None, device: str = "cuda", drafter=None,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, capture: bool | None = None):
        super().__init__(model, head, device=device, drafter=drafter)
        if capture is None:
            capture = self.device.type == "cuda"
        if self.device.type == "cuda":
            lossless_float32()
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes: positive row counts, not {list(batch_sizes)}")
        self.sizes = tuple(sizes)
        self.runner = GraphRunner(self.device, capture)
        self.tables = DeviceTables(self.device, max(self.cfg.level_sizes))
        self.window = self.cfg.max_history
        self._generation = 0  # the tables' buffers the graphs read

    def describe(self) -> dict:
        eager = list(EAGER_FUNCTIONS) + sorted({str(k[0]) for k in self.runner.eager})
        return {"backend": self.name, "device": str(self.device), **self.runner.describe(),
                "batch_sizes": list(self.sizes), "eager": eager}

    def search(self, name: str, enc: EncoderState, trie, widths: tuple[int, ...] = (),
               args: dict[str, torch.Tensor] | None = None):
        """:meth:`Backend.search`, under the runner's lock from its first graph to its value."""
        with self.runner.lock:
            return super().search(name, enc, trie, widths, args)

    # -- graphs --------------------------------------------------------------------------------------------
    def _graphed(self, key: tuple, fn, feeds: list[Feed], out_axes: Sequence[int],
                 to_host: Sequence[bool]) -> list[torch.Tensor]:
        """``fn`` over ``feeds`` as graph ``key`` + the row bucket, in chunks of the largest bucket."""
        first = feeds[0]
        r = first.tensor.shape[first.axis]
        parts = []
        for a, b in chunks(r, self.sizes[-1]):
            part = [Feed(f.tensor.narrow(f.axis, a, b - a), f.axis) for f in feeds]
            parts.append(self.runner.run((*key, bucket(b - a, self.sizes)), fn, part, b - a, out_axes, to_host))
        if len(parts) == 1:
            return parts[0]
        return [torch.cat([p[i] for p in parts], axis) for i, axis in enumerate(out_axes)]

    def _search(self, kind: str, enc: EncoderState, trie, widths: tuple[int, ...], inputs: Sequence[Feed] = (),
                shape: tuple = ()) -> list[torch.Tensor] | None:
        """Whole search ``kind`` of the registry as a graph: its outputs, on the host except what it leaves for a
        search inside its call (its ``left``, kept on the device); None where it
        cannot run here (no NEZHA head or distilled drafter)."""
        s = SEARCHES[kind]
        if (s.uses_head and self.nezha_head is None) or (s.uses_sid_drafter and self.drafter is None):
            return None
        with self.runner.lock, torch.inference_mode():
            tables = [] if trie is None else self.tables.load(trie)
            if trie is not None:
                self._drop_stale()
                shape = (*shape, self.tables.generation)
            fn = functools.partial(_search_fn, s.fn, self.fused, tables, widths)
            enc_mask, cross_k, cross_v = self._fused_encoder(enc)
            feeds = [Feed(enc_mask, 0), Feed(cross_k, 1), Feed(cross_v, 1), *inputs]
            return self._graphed((kind, *widths, *shape), fn, feeds, [_row_axis(n) for n in s.outputs],
                                 [n not in s.left for n in s.outputs])

    def _drop_stale(self) -> None:
        """Forget graphs that read tables' buffers that were replaced (their key's generation is older)."""
        gen = self.tables.generation
        if self._generation != gen:
            self.runner.drop(lambda k: k[0] != "encode" and SEARCHES[k[0]].tables and k[-2] != gen)
            self._generation = gen

    # -- the encoder -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, hist_sids: torch.Tensor) -> EncoderState:
        """[R, H, L] codes, left-padded with rows of -1 -> the encoder state on the device, every history padded
        to the model's window (one graph per row bucket)."""
        _, h, _ = hist_sids.shape
        w = self.window
        x = hist_sids[:, h - w :] if h >= w else F.pad(hist_sids, (0, 0, w - h, 0), value=-1)
        keep, cross_k, cross_v = self._graphed(("encode",), self.fused.encode, [Feed(x)], (0, 1, 1),
                                               (False, False, False))
        return EncoderState(None, keep[:, None, None, :], cross_k.transpose(-1, -2), cross_v)

    # -- whole searches --------------------------------------------------------------------------------------
    def _run_search(self, name: str, enc: EncoderState, trie, widths: tuple[int, ...],
                    inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        s = SEARCHES[name]
        if s.pad is None:
            feeds = [Feed(x, _row_axis(n)) for n, x in zip(s.inputs, inputs)]
            return self._search(name, enc, trie if s.tables else None, widths, feeds)
        m = inputs[-1].shape[1]  # candidates, padded to a bucket
        mb = candidate_bucket(m)
        padded = s.pad(tuple(x.numpy() for x in inputs), mb)
        out = self._search(name, enc, None, widths, [Feed(torch.from_numpy(x)) for x in padded], (mb,))
        return None if out is None else [x[:, :m] for x in out]

    # -- the hot path's single functions, eagerly on the device (under the lock: one GPU, one batch at a time) --
    def _step(self, *args):
        with self.runner.lock:
            return super()._step(*args)

    def _tree(self, *args):
        with self.runner.lock:
            return super()._tree(*args)

    def _head_hidden(self, *args):
        with self.runner.lock:
            return super()._head_hidden(*args)

    # -- warm-up -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def warmup(self, trie, ks=(10,), drafts=DRAFT_FACTORS, scored: tuple[int, ...] = ()) -> None:
        """Capture, for every row bucket (the largest first: the smaller graphs reuse its memory in the pool), the
        encoder and every whole search serving list lengths ``ks`` uses (:meth:`.onnx.OrtBackend.warmup` lists
        them), and ``rank`` for every candidate bucket up to the largest count in ``scored``. A key first met later
        is captured by the call that needs it (a slow call; :attr:`~.graphs.GraphRunner.captured_after_start`
        counts them)."""
        L = self.cfg.sid_len
        gen = torch.Generator().manual_seed(0)
        calls = self.warm_calls(ks, drafts)
        for rb in sorted(self.sizes, reverse=True):
            enc = self.encode(torch.zeros(rb, self.window, L, dtype=torch.int64))
            for name, widths in calls:
                s = SEARCHES[name]
                if s.inputs:  # it runs inside another search's call (``resume``): on example inputs
                    assert s.example is not None  # a search with inputs declares how to make them
                    ex = s.example(self.fused, self._fused_encoder(enc), self.tables.load(trie), *widths)
                    self._run_search(name, enc, trie, widths, list(ex))
                else:
                    self.search(name, enc, trie, widths)
            for s in SEARCHES.values():  # a search the caller hands candidates (``rank``): each count's bucket
                for m in rank_buckets(scored) if s.args else ():
                    sids = torch.stack([torch.randint(0, v, (rb, m), generator=gen) for v in self.cfg.level_sizes], -1)
                    self.search(s.name, enc, None, (), {a: sids for a in s.args})
        self.runner.started = True
