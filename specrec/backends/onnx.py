"""``onnx``: the hot path as ONNX graphs on ONNX Runtime (the CPU default).

The graphs (:mod:`.export`): the functions of :class:`~specrec.models.hotpath.FusedHotPath` -- ``encode``,
``step``, ``tree`` and, with a NEZHA head, ``head`` (its decoder pass) -- with every varying axis dynamic, so
nothing is padded and nothing recompiles, plus ``config.json``. Whole searches are graphs too, one per search of
the registry (:data:`specrec.decoding.searches.SEARCHES`: the export table) and width, exported on first use
(:func:`export_search`) and kept beside the others under the registry's names (:func:`search_name`):
``beam_w{W}`` (the target's constrained beam search), ``head_w{W}`` (the NEZHA head's, its decoder pass
included), ``draft_``, ``draft_scored_``, ``strict_w{W}_n{N}``, ``resume_w{W}`` and ``rank``. They read the item
set's search tables (:mod:`specrec.ids.tables`: per level a dense child table or CSR arrays, and a request's cut
lists) as inputs, made once per catalogue version; a graph is exported per form of the tables (its name ends
``_t`` and the forms: ``beam_w10_tddcc``), so every catalogue size runs whole-search graphs.

:class:`OrtBackend` runs them with full graph optimisations (exported once per weights into
``$SPECREC_CACHE/onnx/<fingerprint>`` unless told where), on the CUDA execution provider when ``onnxruntime-gpu``
finds a GPU, else the CPU. Each graph is kept optimised (``name.ext.onnx``) with its weights in the directory's
one shared data file (:mod:`.weights`: 404 -> ~30 MB for the verifier's 40 graphs). Every graph runs in float32
except where the directory's precision record (``specrec export-onnx``, :mod:`.precision`) chose another for
the scoring pass (``rank``) or nezha's graphs (``draft``) on this machine: :meth:`OrtBackend.describe` says
which. Intra-op threads do not spin while idle (``allow_spinning`` 0), since the process also runs gRPC and
Python; ONNX Runtime logs errors only unless the log level is DEBUG (:func:`~.export.ort_severity`).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..decoding import searches
from ..decoding.searches import SEARCHES, search_name
from ..ids.tables import graph_inputs
from . import precision as prec
from .base import DRAFT_FACTORS, Backend
from .export import (  # noqa: F401 - the export's names, as they were imported from here
    ENC,
    ENC_AXES,
    OPSET,
    _export,
    export_onnx,
    export_search,
    fold_static_dims,
    ort_severity,
    prune_unused,
    quantize_drafter,
    share_constants,
    weights_fingerprint,
)
from .weights import STORE, reads_shared_weights, remove_store, share_weights

if TYPE_CHECKING:
    import onnxruntime as ort

# the export table is the registry of searches (kind -> its function, widths, inputs and outputs); the graphs
# that run the distilled SID drafter are read from it
DRAFTER_KINDS = searches.DRAFTER_KINDS


def default_providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


def session_options(threads: int | None = None, spinning: bool = False, config: dict[str, str] | None = None):
    """ONNX Runtime's options for a hot-path graph: every graph optimisation, ``threads`` intra-op threads (1 unless
    given), one inter-op thread, and threads that sleep between nodes unless ``spinning`` (:class:`OrtBackend`
    says why), its warnings logged only at DEBUG (:func:`~.export.ort_severity`), and ``config``'s entries."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or 1
    so.inter_op_num_threads = 1
    so.log_severity_level = ort_severity()
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    return so


class OrtBackend(Backend):
    name = "onnx"
    graphs = True

    def __init__(self, model, head=None, onnx_dir: str | Path | None = None, threads: int | None = None,
                 providers: list[str] | None = None, drafter=None, drafter_bits: int | None | str = "auto",
                 spinning: bool = False, precision: dict[str, str] | str | None = None):
        """``drafter_bits``: the distilled drafter's weights in the whole-search graphs as 8-bit integers
        (:func:`quantize_drafter`; the target's are never touched), None for float32; "auto": 8 on the
        CPU, float32 where a GPU runs the graphs. ``threads``: intra-op threads, 1 unless given; ``spinning``:
        they spin between the graph's nodes instead of sleeping. Measured at batch 1 on 2 cores
        (bench/results/HISTORY.md, "Before this session"): a beam request took 7.46 ms with one thread, 8.19 ms
        with two that sleep between nodes (each of the graph's ~900 small nodes wakes the other one); two that
        spin ran the graph faster alone but took the cores from all other work in the process (eager torch beside
        them: 120 ms a request instead of 16.7). A machine with more cores and bigger batches sets ``threads`` (the
        verifier's SPECREC_VERIFIER_THREADS). ``precision``: the precision of the graphs whose precision is chosen
        (:data:`~.precision.KINDS`: ``rank``, ``draft``), kind -> one of :data:`~.precision.PRECISIONS`, or one
        for all; None: the directory's record (:mod:`.precision`; float32 where it has none)."""
        super().__init__(model, head, drafter=drafter)
        import onnxruntime as ort

        self._ort = ort
        ort.set_default_logger_severity(ort_severity())
        if onnx_dir is None:  # shared by every process serving these weights
            from ..ids.embed import cache_dir

            onnx_dir = cache_dir() / "onnx" / weights_fingerprint(model, head, drafter)
        d = Path(onnx_dir)
        if not _current(d, model, head, drafter):
            export_onnx(model, d, head, drafter)
        self.options, self.providers_wanted = session_options(threads, spinning), providers or default_providers()
        if drafter_bits == "auto":
            drafter_bits = None if "CUDAExecutionProvider" in self.providers_wanted else 8
        if drafter_bits not in (None, 8):
            raise ValueError(f"drafter_bits: 8 or None, not {drafter_bits!r}")
        self.drafter_bits = drafter_bits if drafter is not None else None
        self.onnx_dir = d
        self.threads, self.spinning = threads, spinning
        if precision is None:
            self.precision = prec.read_precision(d)
        else:
            forced = dict.fromkeys(prec.KINDS, precision) if isinstance(precision, str) else dict(precision)
            bad = {k: v for k, v in forced.items() if k not in prec.KINDS or v not in prec.PRECISIONS}
            if bad:
                raise ValueError(f"precision {bad}: kinds {prec.KINDS}, precisions {prec.PRECISIONS}")
            self.precision = {k: forced.get(k, prec.FLOAT32) for k in prec.KINDS}
        self.sessions: dict[str, ort.InferenceSession] = {}
        self._lock = threading.Lock()
        for name in ("encode", "step", "tree", "head"):
            if self._have(name):
                self._session(name)
        self.providers = self.sessions["encode"].get_providers()

    def describe(self) -> dict:
        return {"backend": self.name, "providers": self.providers, "precision": self.graph_precisions()}

    def graph_precisions(self) -> dict[str, str]:
        """The arithmetic each graph runs in, by graph (the hot path's functions and the registry's searches this
        backend runs): "float32", or the chosen precision of :data:`~.precision.KINDS`; "+drafter_w8" where the
        distilled drafter's weights in it are 8-bit (:func:`~.export.quantize_drafter`)."""
        out = {name: prec.FLOAT32 for name in ("encode", "step", "tree")}
        if self.nezha_head is not None:
            out["head"] = prec.FLOAT32
        for kind, s in SEARCHES.items():
            if (s.uses_head and self.nezha_head is None) or (s.uses_sid_drafter and self.drafter is None):
                continue
            p = self.precision.get(kind, prec.FLOAT32)
            out[kind] = p + ("+drafter_w8" if s.uses_sid_drafter and self.drafter_bits else "")
        return out

    def _session(self, name: str):
        s = self.sessions.get(name)
        if s is None:
            with self._lock:
                s = self.sessions.get(name)
                if s is None:
                    config = prec.session_config(name)
                    so = session_options(self.threads, self.spinning, config) if config else self.options
                    s = self._ort.InferenceSession(str(self._optimized(name)), so, providers=self.providers_wanted)
                    self.sessions[name] = s
        return s

    def _optimized(self, name: str) -> Path:
        """The graph ``name`` as ONNX Runtime's portable optimisations (ORT_ENABLE_EXTENDED: fusions, constant
        folding; no layout for one CPU) left it, saved in its place once (``name.ext.onnx``; the traced graph is
        then removed: the directory's fingerprint, not the file, says whether it is current) on the CPU: a
        session made from it spends less than half the time optimising (measured 0.16 -> 0.07 s per graph; the
        verifier loads some 70 at start). Elsewhere (CUDA) the traced graph itself. Either way its weights go
        to the directory's shared data file (:func:`~.weights.share_weights`) where the directory is writable."""
        src, out = self.onnx_dir / f"{name}.onnx", self.onnx_dir / f"{name}.ext.onnx"
        writable = os.access(self.onnx_dir, os.W_OK)
        if self.providers_wanted != ["CPUExecutionProvider"] or (src.exists() and not out.exists() and not writable):
            if writable and src.exists():
                share_weights(src)
            return src
        if not out.exists():
            so = self._ort.SessionOptions()
            so.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            so.log_severity_level = ort_severity()
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            so.optimized_model_filepath = str(tmp)
            self._ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
            share_weights(tmp)
            tmp.replace(out)
            src.unlink(missing_ok=True)
        return out

    def graph_path(self, name: str) -> Path:
        """The file graph ``name`` is loaded from (its optimised copy where there is one)."""
        return graph_file(self.onnx_dir, name) or self.onnx_dir / f"{name}.onnx"

    def _have(self, name: str) -> bool:
        return graph_file(self.onnx_dir, name) is not None

    def _run(self, name: str, inputs: list[str], args) -> list[torch.Tensor]:
        feed = {k: (v if isinstance(v, np.ndarray) else np.ascontiguousarray(v.numpy())) for k, v in zip(inputs, args)}
        return [torch.from_numpy(x) for x in self._session(name).run(None, feed)]

    # -- the four functions -------------------------------------------------------------
    def _encode(self, hist_sids):
        return tuple(self._run("encode", ["hist_sids"], [hist_sids]))

    def _step(self, *args):
        return tuple(self._run("step", ["tokens", "start", "parent", *ENC, "cache_k", "cache_v"], args))

    def _empty_cache(self, rows: int):
        cfg = self.cfg
        k = torch.zeros(cfg.n_dec_layers, rows, cfg.n_heads, cfg.d_kv, cfg.sid_len)
        return k, torch.zeros(cfg.n_dec_layers, rows, cfg.n_heads, cfg.sid_len, cfg.d_kv)

    def _tree(self, *args):
        return self._run("tree", ["tokens", "positions", "tree_mask", *ENC], args)[0]

    def _head_hidden(self, enc_mask, cross_k, cross_v, placeholders):
        return self._run("head", ENC, [enc_mask, cross_k, cross_v])[0]

    # -- whole searches -------------------------------------------------------------------------
    def table_feed(self, trie) -> tuple[str, dict[str, np.ndarray]]:
        """The trie's search tables (:meth:`~specrec.ids.trie.SidTrie.search_tables`) as a graph's inputs: their
        forms (:func:`~specrec.ids.tables.form_tag`: which graph reads them) and input name -> array (no copy: the
        trie keeps them, so a request's view of it, which brings its own cut lists, piles nothing up here)."""
        return graph_inputs(trie.search_tables(max(self.cfg.level_sizes)))

    def _run_search(self, name: str, enc, trie, widths: tuple[int, ...], inputs: list[torch.Tensor]):
        """Run whole-search graph ``name`` of ``widths`` (exported on first use) over ``trie``'s tables (for a
        search that reads them) and ``inputs`` (the graph's inputs after them)."""
        s = SEARCHES[name]
        tag, tables = self.table_feed(trie) if s.tables else ("", {})
        graph = self._exported(name, *_width_n(widths), tables=tag)
        feed = {**dict(zip(ENC, (enc.keep, enc.cross_k, enc.cross_v))), **tables, **dict(zip(s.inputs, inputs))}
        return self._run_used(graph, feed)

    def _run_used(self, name: str, feed: dict) -> list[torch.Tensor]:
        """Run graph ``name`` on the inputs of ``feed`` that it reads (``resume`` never reads the first levels'
        tables, ``rank`` none)."""
        used = [i.name for i in self._session(name).get_inputs()]
        return self._run(name, used, [feed[k] for k in used])

    def _exported(self, kind: str, width: int | None, n: int | None = None, precision: str | None = None,
                  tables: str = "") -> str:
        """The name of whole-search graph ``kind`` (``width`` None: one without a static width) in ``precision``
        (default: the one chosen for ``kind``, :attr:`precision`) reading tables of the forms ``tables``
        (:meth:`table_feed`), exported first if it is not yet (another precision: built from the float32 graph,
        :func:`~.precision.build_variant`)."""
        bits = self.drafter_bits if kind in DRAFTER_KINDS else None
        base = search_name(kind, width, n, bits, tables)
        name = prec.variant_name(base, precision or self.precision.get(kind, prec.FLOAT32))
        if name not in self.sessions and not self._have(name):
            with self._lock:
                if not self._have(base):
                    export_search(self.model, self.onnx_dir, kind, width, self.nezha_head, self.drafter, n, bits,
                                  tables)
                if name != base and not self._have(name):
                    if not os.access(self.onnx_dir, os.W_OK):  # cannot build it here: float32
                        return base
                    prec.build_variant(self._optimized(base), self.onnx_dir / f"{name}.onnx",
                                       name.removeprefix(base + "_"))
        return name

    def _fused_encoder(self, enc):
        return enc.keep, enc.cross_k, enc.cross_v

    def warmup(self, trie, ks=(10,), drafts=DRAFT_FACTORS, scored: tuple[int, ...] = ()) -> None:
        """Export and load, before serving, the whole-search graphs list lengths ``ks`` use (each search's
        ``warm`` in the registry: :meth:`~.base.Backend.warm_calls`), and, with candidate counts ``scored``
        (``specgr`` ranking by both models: :meth:`~specrec.fusion.Fusion.candidates`), the scoring pass."""
        enc = self.encode(torch.zeros(1, 4, self.cfg.sid_len, dtype=torch.int64))
        for name, widths in self.warm_calls(ks, drafts):
            s = SEARCHES[name]
            if s.inputs:  # it runs inside another search's call (``resume``): its graph is loaded
                self._session(self._exported(name, *_width_n(widths), tables=self.table_feed(trie)[0]))
            else:
                self.search(name, enc, trie, widths)
        if scored:  # a search the caller hands candidates (``rank``): one graph for every count
            for s in SEARCHES.values():
                if s.args:
                    self._session(self._exported(s.name, None))


def _width_n(widths: tuple[int, ...]) -> tuple[int | None, int | None]:
    """A search's static widths as the graph names take them: its width (None: one graph for every size) and
    drafts per level (``n``)."""
    return (widths[0] if widths else None), (widths[1] if len(widths) > 1 else None)


def graph_file(d: Path, name: str) -> Path | None:
    """The file of graph ``name`` in ``d``: its optimised copy (``name.ext.onnx``, which replaces the traced
    graph on the CPU), else the traced graph; None when it is not exported."""
    for f in (d / f"{name}.ext.onnx", d / f"{name}.onnx"):
        if f.exists():
            return f
    return None


def graphs_current(d: Path, model, head, drafter=None) -> bool:
    """Whether ``d`` holds the hot path's graphs exported for exactly these weights and this code (and the shared
    weights file they read)."""
    tree = graph_file(d, "tree")
    if not (d / "config.json").exists() or tree is None:
        return False
    if head is not None and graph_file(d, "head") is None:
        return False
    if not (d / STORE).exists() and reads_shared_weights(tree):
        return False
    meta = json.loads((d / "config.json").read_text())
    return meta.get("fingerprint") == weights_fingerprint(model, head, drafter)


def _current(d: Path, model, head, drafter=None) -> bool:
    """:func:`graphs_current`; where ``d`` holds graphs of other weights, they are removed with their shared
    weights (the graphs of the hot path's functions are exported again, the rest on first use)."""
    if graphs_current(d, model, head, drafter):
        return True
    if not (d / "config.json").exists():
        return False
    for old in d.glob("*.onnx"):
        old.unlink(missing_ok=True)
    remove_store(d)
    return False
