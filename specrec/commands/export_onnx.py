"""``specrec export-onnx``: build every ONNX graph the verifier loads, beside the bundle, choose their
precisions for this machine and check one beam search against eager PyTorch.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export-onnx", help="build every ONNX graph the verifier loads (once, beside the bundle) "
                       "and check it against eager PyTorch")
    x.add_argument("--bundle", required=True)
    x.add_argument("--out", default=None, help="where (default: BUNDLE/onnx, which the verifier then loads)")
    x.add_argument("--k", default="10,50", help="list lengths K whose search graphs to build (the verifier's warmup_k)")
    x.add_argument("--threads", type=int, default=1, help="intra-op threads while building and timing (the "
                   "verifier's: 1)")
    x.add_argument("--precisions", default=None, help="the precisions to try for the scoring pass and nezha's "
                   "graphs, comma-separated (float32, int8, int8_nbits, bf16; default: $SPECREC_PRECISIONS, else "
                   "every one this CPU runs; 'float32' keeps every graph float32)")
    x.add_argument("--precision-users", type=int, default=2000, help="validation users a precision is checked on")
    x.add_argument("--precision-seed", type=int, default=0, help="seed of that sample")
    x.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    """Build every graph the verifier loads (the hot path's functions and the whole searches of each K, batch-1
    and dynamic) into ``--out`` (default: the bundle's ``onnx/``, which the backend then loads instead of
    exporting at start), their weights in one shared file; choose the precision of the scoring pass and of
    nezha's graphs on this machine, checked on validation users (:mod:`specrec.train.precision`); and check
    one beam search against eager PyTorch."""
    import time

    import torch

    from ..backends import Backend
    from ..backends.onnx import OrtBackend
    from ..backends.precision import describe_record
    from ..backends.weights import dir_mb
    from ..bundle import Bundle
    from ..decoding.beam import beam_search
    from ..train.precision import choose_precisions

    t0 = time.perf_counter()
    bundle = Bundle.load(a.bundle)
    out = Path(a.out) if a.out else Path(a.bundle) / "onnx"
    ks = [int(x) for x in a.k.split(",") if x.strip()]
    scored = bundle.scored_counts(ks)
    fp32 = OrtBackend(bundle.model, bundle.nezha_head, onnx_dir=out, drafter=bundle.sid_mlp, threads=a.threads,
                      precision="float32")
    fp32.warmup(bundle.trie, ks, scored=scored)
    t1 = time.perf_counter()
    record = choose_precisions(bundle, fp32, users=a.precision_users, seed=a.precision_seed, forced=a.precisions)
    t2 = time.perf_counter()
    ort_be = OrtBackend(bundle.model, bundle.nezha_head, onnx_dir=out, drafter=bundle.sid_mlp, threads=a.threads)
    ort_be.warmup(bundle.trie, ks, scored=scored)  # the chosen precisions' graphs of every width
    ref = Backend(bundle.model, bundle.nezha_head)
    hist = bundle.history_sids([bundle.sids_t.new_tensor([0, 1, 2]).numpy()])
    with torch.inference_mode():
        eager_beams = beam_search(ref, ref.encode(hist), bundle.trie, 10)
        onnx_beams = ort_be.search("beam", ort_be.encode(hist), bundle.trie, (10,))
    assert onnx_beams is not None
    diff = float((eager_beams.scores - onnx_beams.scores).nan_to_num(0, 0, 0).abs().max())
    n = len({p.name.removesuffix(".onnx").removesuffix(".ext") for p in out.glob("*.onnx")})
    same = bool(torch.equal(eager_beams.codes, onnx_beams.codes))
    for line in describe_record(record):
        print(line)
    print(f"built {n} graphs for K = {ks} in {out} ({dir_mb(out):.0f} MB) in {time.perf_counter() - t0:.0f} s "
          f"(graphs {t1 - t0:.0f} s, precision {t2 - t1:.0f} s; providers {ort_be.providers}); beam search max "
          f"|eager - onnx| = {diff:.2e}, same beams: {same}")
    return 0
