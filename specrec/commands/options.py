"""Option groups shared by the ``specrec`` subcommands, and what is built from them: the model and training
options (``specrec train``), where a training stage runs (``--device``, ``--batch-scale``: every training
command and ``build-bundle``) and the hot-path backend an evaluation asked for (``--backend``, ``--device``,
``--ort-threads``, ``--float-drafter``).
"""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (defaults: TIGER's published size)")
    g.add_argument("--d-model", type=int, default=128)
    g.add_argument("--heads", type=int, default=6)
    g.add_argument("--d-kv", type=int, default=64, help="per-head dimension")
    g.add_argument("--d-ff", type=int, default=1024)
    g.add_argument("--enc-layers", type=int, default=4)
    g.add_argument("--dec-layers", type=int, default=4)
    g.add_argument("--dropout", type=float, default=0.1)
    g.add_argument("--max-history", type=int, default=20, help="items of history fed to the encoder")
    g.add_argument("--encoder-input", choices=["items", "tokens"], default="items",
                   help="one encoder position per item (sum of its code embeddings) or per SID token (TIGER)")
    g.add_argument("--causal-encoder", action="store_true",
                   help="causal encoder, trained on whole sequences at once (several times cheaper per epoch)")
    g.add_argument("--tie-output", action="store_true", help="tie output layers to the code embeddings (T5-style)")
    g.add_argument("--label-smoothing", type=float, default=0.0)
    g.add_argument("--codebook-size", type=int, default=256, help="codes per RQ level")
    g.add_argument("--levels", type=int, default=3, help="RQ levels (the collision digit comes on top)")
    g.add_argument("--collision-size", type=int, default=256, help="largest collision digit + 1")


def add_device_args(g, scale: bool = True) -> None:
    """``--device`` (and ``--batch-scale``) of a training stage (:mod:`specrec.train.device`)."""
    g.add_argument("--device", default="cpu", help="where it trains: cpu (default) or cuda[:N]; the model, its data "
                   "and validation run there, and the run records it")
    if scale:
        g.add_argument("--batch-scale", type=float, default=1.0, metavar="K",
                       help="K times the batch size, the learning rate times sqrt(K) and warm-up steps / K (the "
                       "square-root rule for AdamW, specrec/train/device.py), for a device that wants bigger "
                       "batches; 1 (default) changes nothing. The values a GPU serves are chosen on validation")


def training_device(a: argparse.Namespace) -> str:
    """The ``--device`` asked for, or a clear exit where it is not there."""
    from ..train.device import resolve_device

    try:
        return str(resolve_device(a.device))
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"--device: {e}") from e


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=40)
    g.add_argument("--batch-size", type=int, default=256)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--weight-decay", type=float, default=0.05)
    g.add_argument("--warmup-steps", type=int, default=500)
    g.add_argument("--patience", type=int, default=6, help="epochs without a better validation metric before stopping")
    g.add_argument("--valid-limit", type=int, default=4000,
                   help="validation users, a seeded random sample (0 = all)")
    g.add_argument(
        "--valid-every", type=int, default=1, help="epochs between validations (the last is always validated)"
    )
    g.add_argument(
        "--ema",
        type=float,
        default=0.0,
        help="decay of a moving average of the weights, e.g. 0.999 (0 = off); the better of raw and EMA is kept",
    )
    g.add_argument("--workers", type=int, default=1,
                   help="data-parallel training processes, the same learning per step (2 on a 2-core CPU: "
                        "1.05x to 1.6x the throughput of one, by CPU)")
    g.add_argument("--threads", type=int, default=None, help="torch threads in all (default: every core)")
    g.add_argument(
        "--window-stride",
        type=int,
        default=None,
        help="causal encoder: a training chunk every this many targets, overlapping, so each target keeps at "
        "least max_history - stride + 1 items of context (default: max_history, no overlap)",
    )
    g.add_argument("--history-dropout", type=float, default=0.0,
                   help="causal encoder: drop each input item of a training chunk with this probability (every target "
                   "kept), so targets are also taught from histories without their most recent item (0: off)")
    g.add_argument("--budget-minutes", type=float, default=None,
                   help="plan the epochs (at most --epochs) and the cosine decay to fill this much training time, "
                        "from the first epoch's measured cost")
    g.add_argument("--curve-limit", type=int, default=0,
                   help="test users (a seeded random sample) scored at each validation for the learning curve; "
                        "never used to choose a checkpoint")
    g.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bfloat16 autocast for training matmuls (default: on with --device cuda, off on the CPU; on a CPU only "
        "with AMX/AVX-512 BF16: 10x slower without)",
    )
    add_device_args(g)
    g.add_argument("--checkpoint-minutes", type=float, default=None,
                   help="write a checkpoint whenever this many minutes have passed, mid-epoch too, and when the run "
                   "stops (default: at the end of every epoch on the CPU, every 2 minutes on a GPU, whose epochs "
                   "take seconds); a resumed run goes on after the last batch it saved")
    g.add_argument("--checkpoint-part-mib", type=float, default=None,
                   help="write checkpoints larger than this many MiB in parts of at most that size (files that can "
                   "be committed, or carried off a machine that returns small files); default: one file")
    g.add_argument("--init-from", metavar="BUNDLE", help="start from this bundle's GR weights (same model config)")
    g.add_argument("--teacher", metavar="BUNDLE",
                   help="a bundle whose SASRec gives soft targets on each SID level (with --distill-weight)")
    g.add_argument("--distill-weight", type=float, default=0.0, help="the soft targets' share of the loss (0 = off)")
    g.add_argument("--distill-temp", type=float, default=1.0, help="the teacher's softmax temperature")
    g.add_argument("--seed", type=int, default=0)


def backend_device(a: argparse.Namespace) -> str:
    """The device an eval's eager or cuda backend runs on (--device; default: cuda for --backend cuda)."""
    return a.device or ("cuda" if a.backend == "cuda" else "cpu")


def hot_path_backend(bundle, a: argparse.Namespace):
    """The hot-path backend an eval asked for (--backend, --device, --ort-threads)."""
    name = a.backend or "onnx"
    if name == "eager":
        return bundle.backend(name, device=backend_device(a))
    if name == "cuda":
        sizes = getattr(a, "batch_sizes", None)
        return bundle.backend(name, device=backend_device(a), **({"batch_sizes": sizes} if sizes else {}))
    if a.device not in (None, "cpu"):
        raise SystemExit("--device applies to --backend eager and cuda (ONNX Runtime picks CUDA itself when "
                         "onnxruntime-gpu finds a GPU)")
    kw = {"drafter_bits": None} if getattr(a, "float_drafter", False) else {}
    return bundle.backend(name, threads=a.ort_threads, **kw)
