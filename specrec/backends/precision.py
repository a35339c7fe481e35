"""The precision each scoring graph runs in, chosen per machine when the graphs are built, on validation users.

Two kinds of graph may leave float32 (:data:`KINDS`); every other graph (``encode``, ``step``, ``tree``,
``beam``, ``strict``, ``resume``, ``score``, the head's) stays float32 and computes what eager PyTorch computes:

- ``rank``, the scoring pass (given candidates' log-probabilities: the ``Search`` RPCs ``rank``, and
  ``fused`` ranking SASRec's candidates by both models): judged by the fused list's recall@10;
- ``draft``, ``nezha``'s graph (the target's first decoder pass and the distilled drafter, whose weights are
  8-bit already): judged by ``nezha``'s recall@10.

The candidates (:data:`PRECISIONS`): ``int8``, ONNX Runtime's dynamic quantization of the matrix products with a
constant weight (weights int8 per tensor, activations quantized at every call: ``DynamicQuantizeMatMul``);
``int8_nbits``, its weight-only ``MatMulNBits`` (8 bits, blocks of 32, int8 arithmetic: ``accuracy_level`` 4);
``bf16``, the float32 graph with ONNX Runtime's bf16 fast-math GEMM, only on an arm64 CPU that has bf16 (its CPU
provider has no bf16 kernel on x86, AMX or AVX512_BF16 included; on a CPU without bf16 it would be ~30x slower,
so it is never built, timed or chosen there). ``SPECREC_PRECISIONS`` (or ``export-onnx --precisions``) forces
the list.

:func:`specrec.train.precision.choose_precisions` (``specrec export-onnx``) builds each candidate's graph, times
them side by side in one run (every candidate on the same inputs, one after another, one intra-op thread as the
verifier runs them, batch 1: :func:`time_sessions`), and checks the ones faster than float32 on a seeded sample of
the bundle's validation users (history excluded, as ``specrec tune-fusion`` scores them): a candidate passes when
its recall@10 is at least ``1 - TOLERANCE`` (0.99) of float32's. The fastest that passes is kept (:func:`decide`),
else float32; the choice and its evidence (each candidate's ms and recall, the sample, the CPU flags that matter,
the ONNX Runtime version) go into the graphs directory's ``config.json`` under ``precision``
(:func:`write_precision`), and :class:`~specrec.backends.onnx.OrtBackend` loads the chosen graph
(:func:`variant_name`: ``rank_int8``, ``draft_w10_q8_int8``). A directory without the record (an older build, a
backend's own cache) runs float32. Without validation users (no dataset beside the bundle) or without a fusion
nothing is checked and everything stays float32.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..decoding.searches import SEARCHES

FLOAT32 = "float32"
PRECISIONS = (FLOAT32, "int8", "int8_nbits", "bf16")
#: the graphs whose precision is chosen (the registry's searches that say how they may leave float32)
KINDS = tuple(name for name, s in SEARCHES.items() if s.lossy)
#: a candidate passes with a recall@10 of at least (1 - TOLERANCE) x float32's
TOLERANCE = 0.01
#: times within this share of the fastest are a tie (timing noise): float32 if it is among them, else the better
#: recall, else the first in :data:`PRECISIONS`
MARGIN = 0.02
ENV = "SPECREC_PRECISIONS"
#: the CPU flags that decide what is fast (x86: AVX2 / AVX-512 / VNNI / AMX; arm64: dot product, i8mm, bf16)
FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
         "amx_bf16", "asimddp", "i8mm", "bf16", "sve")
BF16_FASTMATH = "mlas.enable_gemm_fastmath_arm64_bfloat16"


def cpu_flags(cpuinfo: str | None = None) -> dict[str, Any]:
    """This CPU: its architecture, model name and which of :data:`FLAGS` it has (``/proc/cpuinfo``)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    have: set[str] = set()
    model = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features"):
            have |= set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    return {"machine": platform.machine().lower(), "model": model, "flags": [f for f in FLAGS if f in have]}


def has_bf16(cpu: dict) -> bool:
    """Whether the CPU computes in bf16 (AMX or AVX512_BF16 on x86, bf16 on arm64)."""
    return bool({"amx_bf16", "avx512_bf16", "bf16"} & set(cpu["flags"]))


def _bf16_runs(cpu: dict) -> bool:
    """Whether ONNX Runtime's CPU provider can run the bf16 candidate here: arm64 with bf16 (its fast-math GEMM)."""
    return cpu["machine"] in ("aarch64", "arm64") and "bf16" in cpu["flags"]


def candidates(cpu: dict, forced: Sequence[str] | str | None = None) -> tuple[list[str], dict[str, str]]:
    """The precisions to try on this CPU, float32 first (``forced``, else ``$SPECREC_PRECISIONS``, else every one
    it can run) -> (the list, why each other one is left out)."""
    forced = forced if forced is not None else os.environ.get(ENV) or None
    if isinstance(forced, str):
        forced = [p.strip() for p in forced.split(",") if p.strip()]
    unknown = sorted(set(forced or ()) - set(PRECISIONS))
    if unknown:
        raise ValueError(f"unknown precision(s) {unknown} (known: {', '.join(PRECISIONS)})")
    wanted = list(forced) if forced is not None else list(PRECISIONS)
    left: dict[str, str] = {p: "not asked for" for p in PRECISIONS if p not in wanted}
    if "bf16" in wanted and not _bf16_runs(cpu):
        wanted.remove("bf16")
        left["bf16"] = ("ONNX Runtime's CPU provider has no bf16 kernel on x86 (AMX / AVX512_BF16 included)"
                        if has_bf16(cpu) else "the CPU has no bf16 (AMX, AVX512_BF16, arm64 bf16): ~30x slower")
    return [FLOAT32] + [p for p in wanted if p != FLOAT32], left


def variant_name(name: str, precision: str) -> str:
    """The graph of ``name`` (``rank``, ``draft_w10_q8``) in ``precision``: its own file (``rank_int8``)."""
    return name if precision == FLOAT32 else f"{name}_{precision}"


def session_config(name: str) -> dict[str, str]:
    """Session config entries a graph's precision needs (the bf16 candidate: the fast-math GEMM)."""
    return {BF16_FASTMATH: "1"} if name.endswith("_bf16") else {}


def build_variant(src: Path, dst: Path, precision: str) -> None:
    """Write the float32 graph at ``src`` in ``precision`` to ``dst`` (weights inline; the backend optimises it
    and shares its weights as any traced graph's)."""
    import onnx

    from .export import nbits_quantizer, quiet

    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    if precision == "bf16":  # the float32 graph; its session asks for the bf16 GEMM
        onnx.save(onnx.load(str(src)), str(tmp))
    elif precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with quiet():
            quantize_dynamic(onnx.load(str(src)), str(tmp), weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul"])
    elif precision == "int8_nbits":
        nbits = nbits_quantizer()
        cfg = nbits.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=8)
        q = nbits.MatMulNBitsQuantizer(onnx.load(str(src)), bits=8, block_size=32, is_symmetric=True,
                                       accuracy_level=4, algo_config=cfg)
        with quiet():
            q.process()
        q.model.save_model_to_file(str(tmp))
    else:
        raise ValueError(f"no graph is built for precision {precision!r}")
    tmp.replace(dst)


# -- the record -----------------------------------------------------------------------------------------------
def read_precision(d: Path) -> dict[str, str]:
    """The precision chosen for each of :data:`KINDS` in graphs directory ``d`` (float32 where it has no record)."""
    try:
        rec = json.loads((Path(d) / "config.json").read_text()).get("precision", {})
    except (OSError, json.JSONDecodeError):
        rec = {}
    out = {}
    for kind in KINDS:
        p = rec.get(kind, {}).get("chosen", FLOAT32) if isinstance(rec.get(kind), dict) else FLOAT32
        out[kind] = p if p in PRECISIONS else FLOAT32
    return out


def write_precision(d: Path, record: dict) -> None:
    """Keep ``record`` (kind -> its choice and evidence) in ``d``'s ``config.json`` under ``precision``."""
    path = Path(d) / "config.json"
    meta = json.loads(path.read_text())
    meta["precision"] = record
    tmp = path.with_name(f"config.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(path)


def describe_record(record: dict) -> list[str]:
    """The record in a few lines for the terminal: per kind the choice, each candidate's ms and recall."""
    cpu = record.get("cpu", {})
    lines = [f"precision chosen on {cpu.get('model') or cpu.get('machine', '?')} ({', '.join(cpu.get('flags', []))}; "
             f"ONNX Runtime {record.get('onnxruntime', '?')})"
             + "".join(f"; {p}: {why}" for p, why in record.get("left_out", {}).items() if why != "not asked for")]
    for kind in KINDS:
        what = {kind: SEARCHES[kind].lossy}
        r = record.get(kind, {})
        if "candidates" not in r:
            lines.append(f"  {what[kind]}: {r.get('chosen', FLOAT32)} ({r.get('why', 'not measured')})")
            continue
        cells = []
        for p, row in r["candidates"].items():
            cell = f"{p} {row['ms']:.2f} ms"
            if "recall@10" in row:
                cell += f" R@10 {row['recall@10']:.4f}" + (f" ({row['ratio']:.3f}x)" if p != FLOAT32 else "")
            if row.get("verdict") and row["verdict"] != "passes":
                cell += f" [{row['verdict']}]"
            cells.append(cell)
        lines.append(f"  {what[kind]}: {r['chosen']} -- " + ", ".join(cells) + f"; {r.get('judged_by', '')}")
    return lines


# -- measuring ------------------------------------------------------------------------------------------------
def time_sessions(run: Mapping[str, Callable[[Any], object]], feeds: Sequence[Any],
                  rounds: int = 3) -> dict[str, float]:
    """Median ms per call of each of ``run`` (name -> a function of one feed), side by side: every feed is given
    to every one in turn (the order rotating from feed to feed), ``rounds`` times; the first round warms up."""
    names = list(run)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i, feed in enumerate(feeds):
            for j in range(len(names)):
                n = names[(i + j) % len(names)]
                t = time.perf_counter()
                run[n](feed)
                if r:
                    times[n].append(time.perf_counter() - t)
    return {n: round(float(np.median(times[n])) * 1e3, 3) if times[n] else float("nan") for n in names}


def decide(ms: dict[str, float], recall: dict[str, float | None], tolerance: float = TOLERANCE,
           margin: float = MARGIN) -> tuple[str, dict]:
    """The fastest precision whose recall is within ``tolerance`` of float32's (float32 itself always passes),
    times within ``margin`` of the fastest counting as a tie (:data:`MARGIN`) -> (the choice, per candidate its
    ms, recall, ratio to float32 and verdict)."""
    base = recall.get(FLOAT32)
    table: dict[str, dict] = {}
    passed = [FLOAT32]
    for p, t in ms.items():
        row: dict[str, Any] = {"ms": t}
        r = recall.get(p)
        if p != FLOAT32:
            if r is None:
                row["verdict"] = "not checked: no faster than float32" if t >= ms[FLOAT32] else "not checked"
            elif base is not None:
                ok = r >= (1.0 - tolerance) * base
                row["verdict"] = "passes" if ok else f"recall below {1 - tolerance:.2f}x float32's"
                passed += [p] if ok else []
        if r is not None:
            row["recall@10"] = round(r, 5)
            if base:
                row["ratio"] = round(r / base, 4)
        table[p] = row
    fastest = min(ms[p] for p in passed)
    tied = [p for p in passed if ms[p] <= fastest * (1.0 + margin)]
    order = {p: i for i, p in enumerate(PRECISIONS)}
    chosen = FLOAT32 if FLOAT32 in tied else max(tied, key=lambda p: (recall.get(p) or 0.0, -order.get(p, 99)))
    return chosen, table


def run_feed(sess, feed: dict) -> list[np.ndarray]:
    return sess.run(None, {i.name: feed[i.name] for i in sess.get_inputs()})


def remove_unchosen(d: Path, record: dict) -> None:
    """Remove the graphs of the candidates that were not chosen (their weights stay in the shared file: a few MB)."""
    for kind in KINDS:
        chosen = record.get(kind, {}).get("chosen", FLOAT32)
        for p in PRECISIONS[1:]:
            if p != chosen:
                for f in Path(d).glob(f"{kind}*_{p}.*onnx"):
                    if f.name.removesuffix(".onnx").removesuffix(".ext").endswith(f"_{p}"):
                        f.unlink(missing_ok=True)
