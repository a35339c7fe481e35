"""What one decoder pass costs on this machine, by the nodes it verifies: the arithmetic behind `strict`.

A lossless speculative search must still score every prefix the target's beam search keeps (1 + (L-1)W
nodes for width W), so against beam it can only save the fixed cost of the passes it folds together,
and it pays for every drafted node the target did not keep. This measures both terms: for T nodes, one
ONNX graph running the root pass and one pass over T nodes that attend to three ancestors each (the
hot path's own ``FusedHotPath.root`` and ``ancestor_pass``), batch 1, interleaved, ``--threads`` intra-op
threads; a least-squares line through the medians gives the fixed cost per pass and the cost per node,
and the target's whole width-W beam-search graph is timed beside them. Then each graph runs twice in a
row after 64 MB went through the caches (as another graph, another request or a pause does between two
requests in a server): cold (the first run) against warm (the second), with the bytes of weights the graph
holds: what the caches are worth to a pass.

    python -m bench.pass_cost --bundle bundles/beauty-loo

Last, the floor of each beam-search graph, measured in the same run: its weight products alone (every
layer's q|k|v, output, both feed-forward matrices, its cross-attention's two products with the request's
folded keys and values, and the level's output layer, with the model's weights, as many rows as each pass
has: 1 at the root, then the kept beams; and, once, the folding itself), each an independent MatMul in one
graph, run interleaved with the others. That is what the search cannot do with
less: read each pass's weights and multiply them, at this machine's rate for these shapes.
``hotpath.floor_ratio.beam_wW`` is the whole search's time over it.

Writes ``pass_cost.{json,png}`` and the summary keys ``hotpath.pass.fixed_ms``, ``hotpath.pass.node_us``,
``hotpath.floor_ms.beam_wW``, ``hotpath.floor_ratio.beam_wW``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.harness import RESULTS_DIR, command_line
from specrec.eval.results import update_summary


def gemm_floor_graph(fused, rows: list[int], path: Path, s: int = 20) -> tuple[Path, dict]:
    """One ONNX graph with, for each pass of ``rows`` (rows per pass; the first is the root's), every weight
    product of the decoder and the level's output layer as an independent MatMul (input ``x{i}``, random
    rows): each layer's q|k|v, output and both feed-forward matrices, and its cross-attention, as the hot path
    computes it, two products with the request's folded keys [d, h*S] and values [h*S, d]
    (:meth:`~specrec.models.hotpath.FusedHotPath.cross`, histories of ``s`` items), which are made once per
    graph: those products too (query weights times keys, values times output weights, per head). -> (path,
    feed)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    h, dk, d = fused.h, fused.dk, fused.d
    mats: dict[str, np.ndarray] = {}
    for i, layer in enumerate(fused.dec_layers):
        for nm in ("qkv", "o", "fc1_w", "fc2_w"):
            mats[f"l{i}.{nm}"] = getattr(layer, nm).detach().numpy()
        mats[f"l{i}.cross_a"] = rng.standard_normal((d, h * s)).astype(np.float32)
        mats[f"l{i}.cross_b"] = rng.standard_normal((h * s, d)).astype(np.float32)
    nodes, inputs, outputs, feed, inits = [], [], [], {}, []

    def product(a: str, b: str, a_shape, b_shape, out_shape) -> None:
        y = f"y{len(nodes)}"
        for nm, shp in ((a, a_shape), (b, b_shape)):
            if nm.startswith("x"):
                inputs.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, list(shp)))
                feed[nm] = rng.standard_normal(shp).astype(np.float32)
        outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, list(out_shape)))
        nodes.append(helper.make_node("MatMul", [a, b], [y]))

    for i, layer in enumerate(fused.dec_layers):  # the folded keys and values, once per graph
        q, o = layer.cross_q.detach().numpy(), layer.cross_o.detach().numpy()  # [h, d, dk], [h, dk, d]
        inits += [numpy_helper.from_array(np.ascontiguousarray(q), f"l{i}.cross_q"),
                  numpy_helper.from_array(np.ascontiguousarray(o), f"l{i}.cross_o")]
        product(f"l{i}.cross_q", f"x{len(nodes)}k", q.shape, (h, dk, s), (h, d, s))
        product(f"x{len(nodes)}v", f"l{i}.cross_o", (h, s, dk), o.shape, (h, s, d))
    for level, m in enumerate(rows):
        head = f"head{level}"
        mats.setdefault(head, fused.head_w[level].detach().numpy())
        for wname in [*(k for k in mats if k.startswith("l")), head]:
            w = mats[wname]
            product(f"x{len(nodes)}", wname, (m, w.shape[0]), w.shape, (m, w.shape[1]))
    inits += [numpy_helper.from_array(np.ascontiguousarray(w, dtype=np.float32), k) for k, w in mats.items()]
    g = helper.make_graph(nodes, "gemm_floor", inputs, outputs, inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path, feed


class _RootAndPass(torch.nn.Module):
    """The root pass, then one pass over ``t`` nodes of depth ``depth`` (their ancestors: the root, repeated)."""

    def __init__(self, fused, t: int, depth: int = 3):
        super().__init__()
        self.fused, self.t, self.depth = fused, t, depth

    def forward(self, enc_mask, cross_k, cross_v):
        f = self.fused
        cross = f.cross(enc_mask, cross_k, cross_v)
        _, kept = f.root(cross)
        if self.t == 0:
            return kept[-1]
        codes = torch.arange(self.t).view(1, self.t) % min(f.sizes)
        x = f.tok[codes + f.offsets[self.depth - 1]] + f.dec_pos[self.depth]
        own = torch.arange(self.t).view(1, self.t, 1) + 1
        cols = torch.cat([torch.zeros_like(own)] * self.depth + [own], -1)
        hid, _ = f.ancestor_pass(x, cols, kept, cross)
        return torch.log_softmax(hid @ f.head_w[self.depth] + f.head_b[self.depth], dim=-1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--nodes", default="0,10,20,30,60,120", help="T values (0: the root pass alone)")
    ap.add_argument("--widths", default="10,50", help="beam widths whose whole search is timed beside")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (the backend's default: 1)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--cache-iters", type=int, default=100, help="warm/cold pairs per graph (0: skip)")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import onnxruntime as ort

    from specrec.backends.onnx import ENC, ENC_AXES, _export, export_search, search_name
    from specrec.bundle import Bundle
    from specrec.ids.tables import graph_inputs
    from specrec.models.hotpath import FusedHotPath

    b = Bundle.load(a.bundle)
    fused = FusedHotPath(b.model).eval()
    rng = np.random.default_rng(0)
    hists = [torch.from_numpy(b.history_sids([rng.choice(len(b.sids), 20, replace=False)]).numpy()) for _ in range(20)]
    with torch.no_grad():
        encs = [fused.encode(h) for h in hists]
    tag, tables = graph_inputs(b.trie.search_tables(fused.vmax))
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the backend runs them
    tmp = Path(tempfile.mkdtemp(prefix="pass-cost-"))
    graphs: dict[str, ort.InferenceSession] = {}
    nodes = [int(x) for x in a.nodes.split(",")]
    for t in nodes:
        p = tmp / f"pass_{t}.onnx"
        _export(_RootAndPass(fused, t), tuple(encs[0]), ENC, ["out"], ENC_AXES, p)
        graphs[f"T={t}"] = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
    widths = [int(x) for x in a.widths.split(",") if x]
    for w in widths:
        export_search(b.model, tmp, "beam", w, tables=tag)
        graphs[f"beam W={w}"] = ort.InferenceSession(str(tmp / f"{search_name('beam', w, tables=tag)}.onnx"), so,
                                                     providers=["CPUExecutionProvider"])
    feeds = [{"enc_mask": e[0].numpy(), "cross_k": e[1].numpy(), "cross_v": e[2].numpy(),
              **tables} for e in encs]
    floor_feeds = {}
    for w in widths:  # the rows of each pass: 1 at the root, then the beams kept after each level
        rows, kept = [1], 1
        for v in b.cfg.level_sizes[:-1]:
            kept = min(w, kept * v)
            rows.append(kept)
        path, floor_feeds[f"floor W={w}"] = gemm_floor_graph(fused, rows, tmp / f"floor_w{w}.onnx")
        graphs[f"floor W={w}"] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    secs: dict[str, list[float]] = {n: [] for n in graphs}
    for i in range(a.iters):  # interleaved: every graph on the same history, one after another
        f = feeds[i % len(feeds)]
        for n, s in graphs.items():
            feed = floor_feeds[n] if n in floor_feeds else {x.name: f[x.name] for x in s.get_inputs()}
            t0 = time.perf_counter()
            s.run(None, feed)
            secs[n].append(time.perf_counter() - t0)
        if i % 100 == 0:
            print(f"{i}/{a.iters}", flush=True)
    med = {n: float(np.median(v[20:]) * 1e3) for n, v in secs.items()}
    root = med["T=0"]
    xs = np.array([t for t in nodes if t > 0], dtype=float)
    ys = np.array([med[f"T={int(t)}"] - root for t in xs])
    node_ms, fixed_ms = np.polyfit(xs, ys, 1)
    res = {"command": command_line("bench.pass_cost", argv),
           "threads": a.threads, "iters": a.iters, "p50_ms": med, "root_ms": root,
           "pass_fixed_ms": float(fixed_ms), "pass_node_us": float(node_ms * 1e3)}
    for w in widths:  # what its L passes over 1 + (L-1)W nodes would cost by the line, against the graph
        L = b.cfg.sid_len
        res[f"beam_w{w}_by_line_ms"] = float(root + (L - 1) * (fixed_ms + node_ms * w))
        res[f"floor_w{w}_ms"] = med[f"floor W={w}"]
        res[f"floor_ratio_w{w}"] = med[f"beam W={w}"] / med[f"floor W={w}"]
    if a.cache_iters:
        import onnx

        def weights_mb(path: Path) -> float:
            return sum(len(t.raw_data) for t in onnx.load(str(path)).graph.initializer) / 1e6

        paths = {**{f"T={t}": tmp / f"pass_{t}.onnx" for t in nodes},
                 **{f"beam W={w}": tmp / f"{search_name('beam', w, tables=tag)}.onnx" for w in widths}}
        big = np.ones(64 * 2**20 // 8)
        res["cache"] = {}
        for n in ["T=0", f"T={max(nodes)}", *(f"beam W={w}" for w in widths)]:
            s = graphs[n]
            cold, warm = [], []
            for i in range(a.cache_iters):
                f = feeds[i % len(feeds)]
                feed = {x.name: f[x.name] for x in s.get_inputs()}
                big.sum()  # 64 MB through the caches
                for dst in (cold, warm):
                    t0 = time.perf_counter()
                    s.run(None, feed)
                    dst.append(time.perf_counter() - t0)
            res["cache"][n] = {"cold_ms": float(np.median(cold) * 1e3), "warm_ms": float(np.median(warm) * 1e3),
                               "weights_mb": weights_mb(paths[n])}
            print(n, res["cache"][n], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pass_cost.json").write_text(json.dumps(res, indent=1))
    update_summary({"hotpath.pass.fixed_ms": res["pass_fixed_ms"], "hotpath.pass.node_us": res["pass_node_us"],
                    **{f"hotpath.floor_ms.beam_w{w}": res[f"floor_w{w}_ms"] for w in widths},
                    **{f"hotpath.floor_ratio.beam_w{w}": res[f"floor_ratio_w{w}"] for w in widths}},
                   out / "summary.json")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(xs, ys + root, "o", label="root + one pass over T nodes (measured p50)")
    ax.plot(xs, root + fixed_ms + node_ms * xs, "-",
            label=f"fit: {root:.2f} root + {fixed_ms:.2f} per pass + {node_ms * 1e3:.0f} us per node")
    for w in widths:
        ax.axhline(med[f"beam W={w}"], ls="--", color="grey")
        ax.text(xs[0], med[f"beam W={w}"], f" whole beam search W={w}: {med[f'beam W={w}']:.2f} ms", va="bottom")
        ax.axhline(med[f"floor W={w}"], ls=":", color="green")
        ax.text(xs[-1], med[f"floor W={w}"], f"its floor (weight products alone): {med[f'floor W={w}']:.2f} ms "
                f"({res[f'floor_ratio_w{w}']:.2f}x) ", va="bottom", ha="right", color="green", fontsize=8)
    ax.set_xlabel("nodes in the pass (T)")
    ax.set_ylabel("ms, batch 1")
    ax.set_title(f"One decoder pass on this CPU ({a.threads} threads)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "pass_cost.png", dpi=120)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
