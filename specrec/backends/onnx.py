"""``onnx``: the hot path as ONNX graphs on ONNX Runtime (the CPU default).

:func:`export_onnx` writes the functions of :class:`~specrec.models.hotpath.FusedHotPath`
-- ``encode``, ``step``, ``tree`` and, with a NEZHA head, ``head`` (its decoder
pass) -- with every varying axis dynamic, so nothing is padded and nothing
recompiles, plus ``config.json``. Whole searches are graphs too, one per
search of the registry (:data:`specrec.decoding.searches.SEARCHES`: the export
table) and width, exported on first use (:func:`export_search`) and kept beside
the others under the registry's names (:func:`search_name`): ``beam_w{W}.onnx``
(the target's constrained beam search), ``head_w{W}.onnx`` (the NEZHA head's,
its decoder pass included), ``draft_``, ``score_``, ``strict_w{W}_n{N}`` and
``resume_w{W}``. They read the item set as dense child tables, made once per
catalogue version; a catalogue too big for dense tables falls back to
step-by-step search.

:class:`OrtBackend` runs them with full graph optimisations (exported once per
weights into ``$SPECREC_CACHE/onnx/<fingerprint>`` unless told where), on the CUDA
execution provider when ``onnxruntime-gpu`` finds a GPU, else the CPU.
Intra-op threads do not spin while idle (``allow_spinning`` 0), since the
process also runs gRPC and Python.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..decoding import searches
from ..decoding.beam import Beams
from ..decoding.searches import SEARCHES, search_name
from ..models.hotpath import FusedHotPath, child_tables
from ..models.tiger import Tiger
from .base import DRAFT_FACTORS, Backend, draft_count

if TYPE_CHECKING:
    import onnxruntime as ort

OPSET = 18
ENC = ["enc_mask", "cross_k", "cross_v"]
ENC_AXES = {"enc_mask": {0: "R", 1: "S"}, "cross_k": {1: "R", 4: "S"}, "cross_v": {1: "R", 3: "S"}}


class _Fn(nn.Module):
    def __init__(self, fn, *static):
        super().__init__()
        self.fn, self.static = fn, static

    def forward(self, *args):
        return self.fn(*args, *self.static)


class _Search(nn.Module):
    """A whole search (``fn``: a registry search's function, bound to its hot path) with its tables as separate
    inputs and the widths baked in."""

    def __init__(self, fn, n_tables: int, *widths: int, n_extra: int = 0):
        super().__init__()
        self.fn, self.n, self.widths, self.n_extra = fn, n_tables, widths, n_extra

    def forward(self, enc_mask, cross_k, cross_v, *rest):
        tables, extra = rest[: len(rest) - self.n_extra], rest[len(rest) - self.n_extra :]
        return self.fn(enc_mask, cross_k, cross_v, list(tables), *self.widths, *extra)


# the export table is the registry of searches (kind -> its function, widths, inputs and outputs); the graphs
# that run the distilled SID drafter, and the inputs (after the tables) of the graph that finishes a row
# ``strict``'s drafts missed (``resume``'s: what strict's graph leaves), are read from it
DRAFTER_KINDS = searches.DRAFTER_KINDS
RESUME = list(SEARCHES["resume"].inputs)
RANK = list(SEARCHES["rank"].inputs)


def _export(module: nn.Module, args, inputs, outputs, axes, path: Path, post=None) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several processes may export the same graph at once
    torch.onnx.export(module.eval(), args, str(tmp), dynamo=False, opset_version=OPSET, input_names=inputs,
                      output_names=outputs, dynamic_axes=axes, external_data=False)
    share_constants(tmp)
    fold_static_dims(tmp)
    if post is not None:
        post(tmp)
    tmp.replace(path)


def share_constants(path: Path, min_bytes: int = 1024) -> None:
    """Store each distinct large constant of the graph at ``path`` once, as an initializer.

    The tracer folds a weight's transpose into a new constant at every use, so a graph that runs the
    decoder once per level (the beam search: four passes) held four copies of its weights (37 MB of
    constants, 10 MB distinct) and ONNX Runtime kept them all in memory. Identical tensors (same type,
    shape and bytes) now share one initializer; the arithmetic is unchanged."""
    import hashlib

    import onnx

    m = onnx.load(str(path))
    g = m.graph
    canon: dict[bytes, str] = {}
    rename: dict[str, str] = {}
    keep = []
    for node in g.node:
        t = node.attribute[0].t if (node.op_type == "Constant" and len(node.attribute) == 1
                                    and node.attribute[0].name == "value") else None
        if t is None or len(t.raw_data) < min_bytes:
            keep.append(node)
            continue
        key = hashlib.sha256(f"{t.data_type}:{list(t.dims)}:".encode() + t.raw_data).digest()
        if key in canon:
            rename[node.output[0]] = canon[key]
            continue
        canon[key] = node.output[0]
        init = onnx.TensorProto()
        init.CopyFrom(t)
        init.name = node.output[0]
        g.initializer.append(init)
    if rename:
        def fix(graph) -> None:
            for n in graph.node:
                for i, x in enumerate(n.input):
                    if x in rename:
                        n.input[i] = rename[x]
                for a in n.attribute:
                    if a.type == onnx.AttributeProto.GRAPH:
                        fix(a.g)
                    for sub in a.graphs:
                        fix(sub)

        fix(g)
        for o in g.output:  # a graph output that was a duplicate constant: an Identity keeps its name
            if o.name in rename:
                keep.append(onnx.helper.make_node("Identity", [rename[o.name]], [o.name]))
    del g.node[:]
    g.node.extend(keep)
    onnx.save(m, str(path))


def fold_static_dims(path: Path) -> int:
    """Replace, in the graph at ``path``, each read of a tensor's size that ONNX shape inference knows (a
    ``Gather`` of a ``Shape`` at a constant index, or a whole ``Shape`` with every dimension known) by a constant.

    The tracer records every ``.shape`` the hot path reads as ``Shape -> Gather -> Unsqueeze -> Concat`` before
    a ``Reshape``, and keeps the chain when any axis of the tensor is dynamic, though the dimension read is not
    (a beam width, the model's head size): ONNX Runtime folds a ``Shape`` only when the whole shape is known.
    Folded here, the chains end in constants it folds. Measured on beam W=10 (one thread): 1,128 -> 995 nodes
    after ONNX Runtime's optimisations, 4.81 -> 4.61 ms, the same outputs bit for bit. Returns the number of
    reads folded."""
    import onnx
    from onnx import helper, numpy_helper, shape_inference

    m = shape_inference.infer_shapes(onnx.load(str(path)), data_prop=True)
    g = m.graph
    dims: dict[str, list[int | None]] = {}
    for vi in [*g.value_info, *g.input, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            dims[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    scalars = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node
               if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value"}
    shape_of = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Shape" and not n.attribute}

    def constant(name: str, value) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.int64)))

    nodes, folded = [], 0
    for n in g.node:
        known: int | list[int | None] | None = None
        if n.op_type == "Gather" and n.input[0] in shape_of and n.input[1] in scalars:
            d, i = dims.get(shape_of[n.input[0]]), scalars[n.input[1]]
            known = d[int(i)] if d is not None and i.ndim == 0 and -len(d) <= int(i) < len(d) else None
        elif n.op_type == "Shape" and not n.attribute and n.input[0] in dims and None not in dims[n.input[0]]:
            known = dims[n.input[0]]
        if known is not None:
            nodes.append(constant(n.output[0], known))
            folded += 1
        else:
            nodes.append(n)
    if not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        read = {x for n in nodes for x in n.input} | {o.name for o in g.output}
        nodes = [n for n in nodes if n.op_type != "Shape" or n.output[0] in read]  # sizes nothing reads any more
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]  # inferred here; ONNX Runtime infers its own
    onnx.save(m, str(path))
    return folded


def _example_encoder(fused: FusedHotPath, r: int = 2, s: int = 3):
    cfg = fused.cfg
    hist = torch.randint(0, min(cfg.level_sizes), (r, s, cfg.sid_len))
    hist[0, 0] = -1
    with torch.no_grad():
        return hist, fused.encode(hist)


def export_onnx(model: Tiger, out_dir: str | Path, head=None, drafter=None) -> Path:
    """Write the hot path's graphs (no whole searches yet) and config.json to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    fused = FusedHotPath(model, head).eval()
    r, b, t = 2, 3, 5
    hist, (keep, ck, cv) = _example_encoder(fused, r)
    _export(_Fn(fused.encode), (hist,), ["hist_sids"], ENC, {"hist_sids": {0: "R", 1: "S"}, **ENC_AXES},
            out / "encode.onnx")
    cache_k, cache_v = fused.empty_cache(r * 2)
    args = (torch.randint(2, cfg.vocab_size, (r, b)), torch.tensor(1), torch.randint(0, r * 2, (r * b,)),
            keep, ck, cv, cache_k + 0.5, cache_v + 0.5)
    _export(
        _Fn(fused.step),
        args,
        ["tokens", "start", "parent", *ENC, "cache_k", "cache_v"],
        ["logp", "new_k", "new_v"],
        {
            "tokens": {0: "R", 1: "B"},
            "parent": {0: "N"},
            **ENC_AXES,
            "cache_k": {1: "Nc"},
            "cache_v": {1: "Nc"},
            "logp": {0: "N"},
            "new_k": {1: "N"},
            "new_v": {1: "N"},
        },
        out / "step.onnx",
    )
    mask = torch.rand(r, t, t) > 0.5
    mask |= torch.eye(t, dtype=torch.bool)
    tree_args = (torch.randint(2, cfg.vocab_size, (r, t)), torch.randint(0, cfg.sid_len, (r, t)), mask, keep, ck, cv)
    _export(_Fn(fused.tree), tree_args, ["tokens", "positions", "tree_mask", *ENC], ["logp"],
            {"tokens": {0: "R", 1: "T"}, "positions": {0: "R", 1: "T"}, "tree_mask": {0: "R", 1: "T", 2: "T"},
             **ENC_AXES, "logp": {0: "R", 1: "T"}}, out / "tree.onnx")
    if head is not None:
        _export(_Fn(fused.head_hidden), (keep, ck, cv), ENC, ["hidden"], {**ENC_AXES, "hidden": {0: "R"}},
                out / "head.onnx")
    meta = {"model": cfg.model_dump(), "fingerprint": weights_fingerprint(model, head, drafter)}
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def weights_fingerprint(*modules) -> str:
    """sha256 (first 16 hex digits) of the modules' weights and of the code the graphs are traced
    from (this file, the hot path, the head's functions, the constrained top-k and every module of the
    registry of searches): exported graphs belong to exactly these."""
    import hashlib
    import inspect

    from ..decoding import topk
    from ..models import hotpath, nezha_head

    code = [Path(inspect.getfile(m)) for m in (hotpath, nezha_head, topk)]
    code += sorted(Path(inspect.getfile(searches)).parent.glob("*.py"))
    h = hashlib.sha256(b"".join(f.read_bytes() for f in code) + Path(__file__).read_bytes())
    for m in modules:
        if m is None:
            continue
        for k, v in sorted(m.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def export_search(model: Tiger, out_dir: str | Path, kind: str, width: int | None, head=None, drafter=None,
                  n: int | None = None, drafter_bits: int | None = None) -> Path:
    """Write the whole-search graph ``kind`` (see :data:`SEARCHES`) of ``width`` (and ``n`` drafts per level,
    for 'strict') as ``search_name(kind, width, n, drafter_bits).onnx``, the drafter's weights quantized to
    ``drafter_bits`` where given (:func:`quantize_drafter`)."""
    out = Path(out_dir)
    fused = FusedHotPath(model, head, drafter).eval()
    hist, enc = _example_encoder(fused, 2)
    sids = torch.stack([torch.randint(0, v, (16,)) for v in model.cfg.level_sizes], 1)
    from ..ids.trie import SidTrie

    tables = child_tables(SidTrie(sids.numpy(), model.cfg.level_sizes), fused.vmax)
    if tables is None:
        raise ValueError(f"a level of {model.cfg.level_sizes} is too big for dense child tables")
    names = [f"table{j}" for j in range(len(tables))]
    search = SEARCHES[kind]
    outputs = list(search.outputs)
    widths = () if not search.widths else (width,) if n is None else (width, n)
    if len(widths) != len(search.widths):
        raise ValueError(f"search {kind!r} takes {', '.join(search.widths) or 'no width'}")
    path = out / f"{search_name(kind, width if search.widths else None, n, drafter_bits)}.onnx"
    declared = search.axes or {}
    axes = {**ENC_AXES, **{nm: {0: f"nodes{j}"} for j, nm in enumerate(names)},
            **{o: declared.get(o, {1 if o.startswith("kept") else 0: "R"}) for o in outputs}}
    extra: tuple = ()
    if search.inputs:  # another graph's outputs (resume: strict's): an example of them
        assert search.example is not None  # a search with inputs declares how to make them
        with torch.no_grad():
            extra = tuple(search.example(fused, enc, tables, width))
        axes.update({nm: declared.get(nm, {1 if nm.startswith("kept") else 0: "R"}) for nm in search.inputs})
    # the hot path is not a submodule: its weights are traced as constants (:func:`share_constants`)
    _export(_Search(functools.partial(search.fn, fused), len(tables), *widths, n_extra=len(extra)),
            (*enc, *tables, *extra), [*ENC, *names, *(search.inputs if extra else [])], outputs, axes, path,
            post=(lambda p: quantize_drafter(p, drafter, drafter_bits)) if drafter_bits and drafter is not None
            else None)
    return path


def quantize_drafter(path: Path, drafter: nn.Module, bits: int = 8) -> int:
    """The distilled drafter's matrix products in the graph at ``path`` with ``bits``-bit weights: ONNX
    Runtime's weight-only MatMulNBits (symmetric, blocks of 32 along the input axis, int8 arithmetic).

    The drafter's 4.3 MB of weights become 1.1 MB; on 500 validation users ``nezha`` (whose graph is the
    target's BOS pass and the drafter) went from 1.89x to 1.97x of beam's speed with the same recall, and
    its lists hold 97.5% of the float32 drafter's SIDs. Its products are found by their weights (the
    drafter's linear layers, as the tracer stored them), so the target's are never quantized: level 0 and
    every score the target gives stay exact, and ``strict`` still returns exactly beam's lists (the drafts
    only decide what is verified). Returns the number of products quantized."""
    import hashlib
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    def key(a: np.ndarray) -> bytes:
        return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).digest()

    ours = set()
    for m in drafter.modules():
        if isinstance(m, nn.Linear):
            w = m.weight.detach().float().numpy()
            ours |= {key(w), key(w.T)}
    model = onnx.load(str(path))
    inits = {t.name: key(onnx.numpy_helper.to_array(t)) for t in model.graph.initializer if len(t.raw_data) >= 1024}
    nodes = [n.name for n in model.graph.node if n.op_type == "MatMul" and inits.get(n.input[1]) in ours]
    if not nodes:
        return 0

    def matmuls(g) -> list[str]:
        out = [n.name for n in g.node if n.op_type == "MatMul"]
        for n in g.node:
            for a in n.attribute:
                out += [x for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs) for x in matmuls(sub)]
        return out

    others = sorted(set(matmuls(model.graph)) - set(nodes))  # the quantizer takes every MatMul it is not told to skip
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=bits)
    q = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4,
                             nodes_to_exclude=others, algo_config=cfg)
    q.process()
    q.model.save_model_to_file(str(path))
    return len(nodes)


def default_providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


def session_options(threads: int | None = None, spinning: bool = False):
    """ONNX Runtime's options for a hot-path graph: every graph optimisation, ``threads`` intra-op threads (1 unless
    given), one inter-op thread, and threads that sleep between nodes unless ``spinning`` (:class:`OrtBackend`
    says why)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return so


class OrtBackend(Backend):
    name = "onnx"

    def __init__(self, model, head=None, onnx_dir: str | Path | None = None, threads: int | None = None,
                 providers: list[str] | None = None, drafter=None, drafter_bits: int | None | str = "auto",
                 spinning: bool = False):
        """``drafter_bits``: the distilled drafter's weights in the whole-search graphs as 8-bit integers
        (:func:`quantize_drafter`; the target's are never touched), None for float32; "auto": 8 on the
        CPU, float32 where a GPU runs the graphs. ``threads``: intra-op threads, 1 unless given; ``spinning``:
        they spin between the graph's nodes instead of sleeping. Measured at batch 1 on 2 cores
        (bench/results/HISTORY.md, "Before this session"): a beam request took 7.46 ms with one thread, 8.19 ms
        with two that sleep between nodes (each of the graph's ~900 small nodes wakes the other one); two that
        spin ran the graph faster alone but took the cores from all other work in the process (eager torch beside
        them: 120 ms a request instead of 16.7). A machine with more cores and bigger batches sets ``threads`` (the
        verifier's SPECREC_VERIFIER_THREADS)."""
        super().__init__(model, head, drafter=drafter)
        import onnxruntime as ort

        self._ort = ort
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
        self.sessions: dict[str, ort.InferenceSession] = {}
        self._lock = threading.Lock()
        for name in ("encode", "step", "tree", "head"):
            if self._have(name):
                self._session(name)
        self.providers = self.sessions["encode"].get_providers()

    def describe(self) -> dict:
        return {"backend": self.name, "providers": self.providers}

    def _session(self, name: str):
        s = self.sessions.get(name)
        if s is None:
            with self._lock:
                s = self.sessions.get(name)
                if s is None:
                    s = self._ort.InferenceSession(str(self._optimized(name)), self.options,
                                                   providers=self.providers_wanted)
                    self.sessions[name] = s
        return s

    def _optimized(self, name: str) -> Path:
        """The graph ``name`` as ONNX Runtime's portable optimisations (ORT_ENABLE_EXTENDED: fusions, constant
        folding; no layout for one CPU) left it, saved in its place once (``name.ext.onnx``; the traced graph is
        then removed: the directory's fingerprint, not the file, says whether it is current) on the CPU: a
        session made from it spends less than half the time optimising (measured 0.16 -> 0.07 s per graph; the
        verifier loads some 70 at start). Elsewhere (CUDA) the traced graph itself."""
        src, out = self.onnx_dir / f"{name}.onnx", self.onnx_dir / f"{name}.ext.onnx"
        if self.providers_wanted != ["CPUExecutionProvider"] or (src.exists() and not out.exists()
                                                                and not os.access(self.onnx_dir, os.W_OK)):
            return src
        if not out.exists():
            so = self._ort.SessionOptions()
            so.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            so.optimized_model_filepath = str(tmp)
            self._ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
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
    def _tables_of(self, trie) -> list[np.ndarray] | None:
        """The trie's child tables as arrays (no copy); the trie keeps them, so a request's view of it
        (:meth:`~specrec.ids.trie.SidTrie.excluding`) brings its own and nothing piles up here."""
        t = child_tables(trie, max(self.cfg.level_sizes))
        return None if t is None else [x.numpy() for x in t]

    def _whole(self, kind: str, enc, trie, width: int, n: int | None = None):
        """Run whole-search graph ``kind`` (exported on first use): its outputs, or None where it cannot run."""
        tables = self._tables_of(trie)
        if (
            tables is None
            or (SEARCHES[kind].uses_head and self.nezha_head is None)
            or (SEARCHES[kind].uses_sid_drafter and self.drafter is None)
        ):
            return None
        name = self._exported(kind, width, n)
        names = [f"table{j}" for j in range(len(tables))]
        return self._run(name, [*ENC, *names], [enc.keep, enc.cross_k, enc.cross_v, *tables])

    def _exported(self, kind: str, width: int | None, n: int | None = None) -> str:
        """The name of whole-search graph ``kind`` (``width`` None: one without a static width), exported first if
        it is not yet."""
        bits = self.drafter_bits if kind in DRAFTER_KINDS else None
        name = search_name(kind, width, n, bits)
        if name not in self.sessions and not self._have(name):
            with self._lock:
                if not self._have(name):
                    export_search(self.model, self.onnx_dir, kind, width, self.nezha_head, self.drafter, n, bits)
        return name

    def _ranked(self, enc, inputs: list[torch.Tensor]) -> torch.Tensor:
        name = self._exported("rank", None)
        feed = dict(zip([*ENC, *RANK], [enc.keep, enc.cross_k, enc.cross_v, *inputs]))
        used = [i.name for i in self._session(name).get_inputs()]  # it reads no tables
        return self._run(name, used, [feed[k] for k in used])[0]

    def beam(self, enc, trie, width: int):
        out = self._whole("beam", enc, trie, width)
        return None if out is None else Beams.of_search(*out)

    def head(self, enc, trie, width: int):
        out = self._whole("head", enc, trie, width)
        return None if out is None else Beams.of_search(*out)

    def _fused_encoder(self, enc):
        return enc.keep, enc.cross_k, enc.cross_v

    def _table(self, trie, level: int) -> torch.Tensor:
        tables = self._tables_of(trie)
        assert tables is not None
        return torch.from_numpy(tables[level])

    def resume(self, enc, trie, width: int, state: list[torch.Tensor]) -> list[torch.Tensor]:
        name = self._exported("resume", width)
        tables = self._tables_of(trie)
        assert tables is not None  # strict's graph ran on them
        feed = dict(zip([*ENC, *[f"table{j}" for j in range(len(tables))], *RESUME],
                        [enc.keep, enc.cross_k, enc.cross_v, *tables, *state]))
        used = [i.name for i in self._session(name).get_inputs()]  # it never reads the first levels' tables
        return self._run(name, used, [feed[k] for k in used])

    def _drafted(self, kind: str, enc, trie, width: int, n: int | None):
        return self._whole(kind, enc, trie, width, n)

    def warmup(self, trie, ks=(10,), drafts=DRAFT_FACTORS, scored: tuple[int, ...] = ()) -> None:
        """Export and load, before serving, the whole-search graphs a list length K uses: the beam search
        of width K, and, for every draft count ``m * K`` (m in ``drafts``) the policies use, the head's
        searches and ``strict``'s draft-and-verify graphs; the distilled drafter's searches of width K and 2K,
        and its scored search of width 2K (``specgr``'s first round); the scoring pass (``rank``) of each
        candidate count in ``scored`` (``specgr`` ranking by both models: :meth:`~specrec.fusion.Fusion.candidates`)."""
        if scored:
            self._session(self._exported("rank", None))
        enc = self.encode(torch.zeros(1, 4, self.cfg.sid_len, dtype=torch.int64))
        for k in ks:
            self.beam(enc, trie, k)
            if self.drafter is not None:  # nezha drafts K and 2K beams; specgr's first round scores 2K
                self.draft(enc, trie, k)
                self.draft(enc, trie, 2 * k)
                self.score(enc, trie, 2 * k)
            for m in drafts:
                if self.nezha_head is not None:
                    self.head(enc, trie, draft_count(m, k))
                if self.drafter is not None:
                    self.strict(enc, trie, k, draft_count(m, k))
            if self.drafter is not None and self.cfg.sid_len >= 3:  # what finishes a row strict's drafts missed
                self._session(self._exported("resume", k))


def graph_file(d: Path, name: str) -> Path | None:
    """The file of graph ``name`` in ``d``: its optimised copy (``name.ext.onnx``, which replaces the traced
    graph on the CPU), else the traced graph; None when it is not exported."""
    for f in (d / f"{name}.ext.onnx", d / f"{name}.onnx"):
        if f.exists():
            return f
    return None


def graphs_current(d: Path, model, head, drafter=None) -> bool:
    """Whether ``d`` holds the hot path's graphs exported for exactly these weights and this code."""
    if not (d / "config.json").exists() or graph_file(d, "tree") is None:
        return False
    if head is not None and graph_file(d, "head") is None:
        return False
    meta = json.loads((d / "config.json").read_text())
    return meta.get("fingerprint") == weights_fingerprint(model, head, drafter)


def _current(d: Path, model, head, drafter=None) -> bool:
    """:func:`graphs_current`; where ``d`` holds graphs of other weights, their whole-search graphs are removed."""
    if graphs_current(d, model, head, drafter):
        return True
    if not (d / "config.json").exists():
        return False
    # whole-search graphs of other weights, and every optimised copy (the graphs of the hot path's functions are
    # exported again); a set: an optimised whole-search graph matches both patterns
    for old in {*d.glob("*_w*.onnx"), *d.glob("*.ext.onnx")}:
        old.unlink(missing_ok=True)
    return False
