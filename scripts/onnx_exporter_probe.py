"""A short probe of what moving the verifier's graph export to PyTorch's ``torch.export``-based ONNX exporter
(``torch.onnx.export(..., dynamo=True)``) costs, on one bundle's graphs: for each graph asked, the export's wall
time, whether it succeeds, the graph's nodes after SpecRec's own clean-up, ONNX Runtime's time per call and the
largest difference from eager PyTorch, with the TorchScript exporter (what specrec export-onnx runs today) and
with the new one, side by side. What it found is in docs/onnx.md ("The exporter").

    .venv/bin/python scripts/onnx_exporter_probe.py --bundle bundles/beauty-loo --graphs encode,beam

A probe, not a benchmark: a few dozen calls per graph, one thread; the export itself runs the code of
specrec/backends/export.py unchanged, with only the exporter switched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import traceback
from pathlib import Path


def dynamic_shapes(module, input_names: list[str], dynamic_axes: dict) -> tuple:
    """The TorchScript exporter's ``dynamic_axes`` (input name -> {axis: name}) as ``torch.export``'s
    ``dynamic_shapes``, shaped like ``module.forward``'s parameters (a ``*args`` parameter takes a tuple); every
    dynamic axis ``Dim.AUTO``, so that ``torch.export`` finds which of them are equal."""
    import inspect

    from torch.export import Dim

    specs = [{ax: Dim.AUTO for ax in dynamic_axes.get(name, {})} or None for name in input_names]
    params = list(inspect.signature(module.forward).parameters.values())
    fixed = [q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    out: list = specs[: len(fixed)]
    if any(q.kind == q.VAR_POSITIONAL for q in params):
        out.append(tuple(specs[len(fixed):]))
    return tuple(out)


@contextlib.contextmanager
def exporter(dynamo: bool):
    """``torch.onnx.export`` as specrec.backends.export calls it; with ``dynamo``, the new exporter, its
    ``dynamic_axes`` given as ``dynamic_shapes`` (it cannot convert them itself)."""
    import torch

    real = torch.onnx.export

    def export(module, args, f, **kwargs):
        if dynamo:
            kwargs["dynamo"] = True
            kwargs["dynamic_shapes"] = dynamic_shapes(module, kwargs["input_names"], kwargs.pop("dynamic_axes"))
            kwargs["verbose"] = False
        return real(module, args, f, **kwargs)

    torch.onnx.export = export
    try:
        yield
    finally:
        torch.onnx.export = real


def ort_ms(path: Path, feeds: dict, calls: int) -> tuple[float, list]:
    """Median milliseconds of one call of the graph at ``path`` on ``feeds`` (one thread), and its outputs."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    out = sess.run(None, feeds)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t0) * 1000.0)
    return float(np.median(times)), out


def probe(bundle_dir: str, graph: str, mode: str, calls: int) -> dict:
    """Export ``graph`` (``encode``, or a search of the registry at width 10) of the bundle's model with the
    TorchScript exporter (``mode`` torchscript) or the new one (``dynamo``: with the graph's dynamic axes, as the
    backend needs them; ``static``: encode only, every shape fixed to the probe's input), then time it in ONNX
    Runtime and check it against eager."""
    import functools

    import numpy as np
    import onnx
    import torch

    from specrec.backends import export as ex
    from specrec.bundle import Bundle
    from specrec.decoding.searches import SEARCHES
    from specrec.ids.tables import graph_inputs

    b = Bundle.load(bundle_dir)
    model = b.model.eval()
    fused = ex.FusedHotPath(model).eval()
    out = Path(tempfile.mkdtemp(prefix="onnx-probe-"))
    res: dict = {"graph": graph, "exporter": mode}
    tag, tables = graph_inputs(b.trie.search_tables(max(model.cfg.level_sizes)))  # the bundle's own catalogue
    torch.manual_seed(0)
    hist = torch.randint(0, min(model.cfg.level_sizes), (1, 20, model.cfg.sid_len))  # one user, 20 items
    t0 = time.perf_counter()
    try:
        if mode == "static":  # no dynamic axis: a graph for this one shape (what the backend cannot use)
            path = out / "encode.onnx"
            torch.onnx.export(ex._Fn(fused.encode).eval(), (hist,), str(path), dynamo=True, opset_version=ex.OPSET,
                              input_names=["hist_sids"], output_names=ex.ENC, external_data=False, verbose=False)
        else:
            with exporter(mode == "dynamo"):
                if graph == "encode":
                    path = ex.export_onnx(model, out) / "encode.onnx"
                else:
                    path = ex.export_search(model, out, graph, 10, tables=tag)
    except Exception as e:  # noqa: BLE001 - the probe reports any failure of the exporter
        summary = str(e).split("## Exception summary")[-1].strip()  # torch.onnx's own summary of the cause
        res.update(ok=False, export_s=round(time.perf_counter() - t0, 1), error=f"{type(e).__name__}: {summary}"[:700],
                   where=traceback.format_exc()[-1200:])
        return res
    res.update(ok=True, export_s=round(time.perf_counter() - t0, 1), nodes=len(onnx.load(str(path)).graph.node),
               bytes=path.stat().st_size)
    with torch.no_grad():
        enc = fused.encode(hist)
        if graph == "encode":
            want = list(enc)
            feeds = {"hist_sids": hist.numpy()}
        else:
            flat = [torch.from_numpy(v) for v in tables.values()]
            want = list(ex._Search(functools.partial(SEARCHES[graph].fn, fused), tag, 10)(*enc, *flat))
            feeds = {**dict(zip(ex.ENC, (x.numpy() for x in enc))), **tables}
    res["ms"], got = ort_ms(path, feeds, calls)
    res["max_abs_diff"] = float(max(np.abs(np.asarray(g, np.float64) - w.double().numpy()).max()
                                    for g, w in zip(got, want)))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--graphs", default="encode,beam", help="encode (the encoder) and/or searches of the registry")
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args(argv)
    for graph in a.graphs.split(","):
        for mode in ("torchscript", "dynamo", *(("static",) if graph == "encode" else ())):
            print(json.dumps(probe(a.bundle, graph, mode, a.calls)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
