"""The GR model's learning curve: validation and test Recall@10 against training minutes.

``specrec train --curve-limit N`` scores, at every validation, the kept weights on a fixed seeded
sample of N test users besides the fixed sample of validation users that chooses them (the test
curve never chooses). This reads the run's ``train_log.jsonl`` (a bundle's copy of it, or else its
``bundle.json``, where the run's curve is kept as ``training.curve``) and plots both curves, with the learning rate,
so anyone can see where more compute would take the model.

    python -m bench.learning_curve --run runs/beauty-loo-r3 --out bench/results/beauty_loo_learning_curve
    python -m bench.learning_curve --bundle bundles/beauty-loo --out bench/results/beauty_loo_learning_curve
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path | None, bundle: Path | None) -> list[dict]:
    if run is None and (bundle / "train_log.jsonl").exists():  # type: ignore[operator]
        run = bundle  # the run's own log, copied into the bundle: unlike its curve, it names the weights kept
    if run is not None:
        return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]
    meta = json.loads((bundle / "bundle.json").read_text())  # type: ignore[operator]
    curve = meta.get("training", {}).get("curve")
    if not curve:
        raise SystemExit(f"{bundle}: its training recorded no curve (train with --curve-limit)")
    return curve


def plot(rows: list[dict], out: Path, title: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if "valid.recall@10" in r]
    minutes = [r["minutes"] for r in pts]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(minutes, [r["valid.recall@10"] for r in pts], "o-", label="validation R@10 (chooses)")
    if any("test.recall@10" in r for r in pts):
        tp = [r for r in pts if "test.recall@10" in r]
        ax.plot([r["minutes"] for r in tp], [r["test.recall@10"] for r in tp], "s-", label="test R@10 (reported only)")
    if any("valid_ema.recall@10" in r for r in pts):
        ax.plot(minutes, [r.get("valid_ema.recall@10") for r in pts], ":", color="grey", label="validation R@10, EMA")
    ax.set_xlabel("training minutes (train + validation, 2 CPU cores)")
    ax.set_ylabel("Recall@10 (beam width 10, fixed random samples)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot([r["minutes"] for r in rows if "minutes" in r], [r["lr"] for r in rows if "minutes" in r], color="tab:red",
             alpha=0.35, label="learning rate")
    ax2.set_ylabel("learning rate", color="tab:red")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=120)
    last = pts[-1] if pts else {}
    summary = {"epochs": rows[-1]["epoch"] if rows else 0, "minutes": last.get("minutes"),
               "valid.recall@10": last.get("valid.recall@10"), "test.recall@10": last.get("test.recall@10"),
               "points": [{k: r.get(k) for k in ("epoch", "minutes", "lr", "valid.recall@10", "valid_ema.recall@10",
                                                  "test.recall@10", "best")}
                          for r in pts]}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, help="a `specrec train --out` directory")
    src.add_argument("--bundle", type=Path, help="a bundle whose training kept its curve")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix (.png and .json are written)")
    p.add_argument("--title", default="GR model on Amazon Beauty (leave-one-out): learning curve")
    a = p.parse_args(argv)
    s = plot(load(a.run, a.bundle), a.out, a.title)
    print(json.dumps({k: v for k, v in s.items() if k != "points"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
