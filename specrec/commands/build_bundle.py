"""``specrec build-bundle``: one command from a dataset to a served bundle.

The stages are the commands a bundle was built with by hand, run in order on ``OUT/bundle``, each with the
options a recipe gives it (a JSON file: stage name -> that command's options; a stage left out runs with the
command's defaults, a stage set to ``null`` is not built):

    gr        specrec train           split, semantic IDs, the GR model (resumes from OUT/checkpoint.pt)
    sasrec    specrec train-baseline  the SASRec baseline (the item drafter of ``fused`` and ``drafter``)
    drafters  specrec train-drafters  the retrieval drafter, self-draft and NEZHA heads, the distilled drafter
    fusion    specrec tune-fusion     how ``fused`` weighs both models, chosen on validation users
    graphs    specrec export-onnx     the verifier's ONNX graphs and their precisions on this machine

A stage is skipped when it is current: ``bundle.json`` (``build.stages``) records, per stage, a key of its own
options and of the keys of the stages before it, and its outputs are there. So a re-run after an interruption
goes on where it stopped, and a change of one stage's options rebuilds that stage and every one after it. The
minutes each stage took go into ``build.stages.<name>.minutes`` and their sum into ``build.minutes`` (``specrec
eval`` reports it as ``<dataset>.build.minutes``).

    specrec build-bundle --data data/beauty --out runs/beauty-loo --recipe recipes/beauty-loo.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

from . import export_onnx, train, train_baseline, train_drafters, tune_fusion


@dataclass(frozen=True)
class BuildStage:
    name: str
    cmd: str  # its ``specrec`` subcommand
    command: ModuleType  # that subcommand's module of specrec.commands: add_parser(sub), run(args)
    place: Callable[[argparse.Namespace, Path], list[str]]  # the options that say where: data, out, bundle
    done: Callable[[Path, dict], bool]  # its outputs are in the bundle (directory, bundle.json)


def _drafters_done(b: Path, meta: dict) -> bool:
    files = {"retrieval": "retrieval.safetensors", "self": "self_draft.safetensors",
             "nezha": "nezha_head.safetensors", "distill": "sid_mlp.safetensors"}
    stage = meta.get("build", {}).get("stages", {}).get("drafters", {})
    which = _option(stage.get("argv", []), "--which", "retrieval,self,nezha")
    return all((b / files[w.strip()]).exists() for w in which.split(",") if w.strip() in files)


def _option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


STAGES: tuple[BuildStage, ...] = (
    BuildStage("gr", "train", train, lambda a, out: ["--data", a.data, "--protocol", a.protocol, "--out", str(out)],
               lambda b, meta: (b / "model.safetensors").exists()),
    BuildStage("sasrec", "train-baseline", train_baseline, lambda a, out: ["--bundle", str(out / "bundle")],
               lambda b, meta: (b / "sasrec.safetensors").exists()),
    BuildStage("drafters", "train-drafters", train_drafters, lambda a, out: ["--bundle", str(out / "bundle")],
               _drafters_done),
    BuildStage("fusion", "tune-fusion", tune_fusion, lambda a, out: ["--bundle", str(out / "bundle")],
               lambda b, meta: bool(meta.get("fusion"))),
    BuildStage("graphs", "export-onnx", export_onnx, lambda a, out: ["--bundle", str(out / "bundle")],
               lambda b, meta: (b / "onnx" / "config.json").exists()),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-bundle", help="build a served bundle from a dataset in one command (every stage, "
                       "each skipped when current)", description=(__doc__ or "").split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic", help="dataset directory or 'synthetic'")
    p.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    p.add_argument("--out", required=True, help="run directory: checkpoints, logs and OUT/bundle")
    p.add_argument("--recipe", help="JSON file: stage -> that command's options (a list of strings), or null to "
                   f"leave the stage out; stages: {', '.join(s.name for s in STAGES)}")
    p.add_argument("--dry-run", action="store_true", help="say which stages would run, run none")
    p.set_defaults(func=run)


def read_recipe(path: str | None) -> dict[str, list[str] | None]:
    """The recipe's options per stage (a stage it does not name: the command's defaults, ``[]``)."""
    recipe = json.loads(Path(path).read_text()) if path else {}
    unknown = set(recipe) - {s.name for s in STAGES} - {"comment"}
    if unknown:
        raise SystemExit(f"recipe {path}: unknown stages {sorted(unknown)} (known: {[s.name for s in STAGES]})")
    out: dict[str, list[str] | None] = {}
    for s in STAGES:
        opts = recipe.get(s.name, [])
        if opts is not None and not (isinstance(opts, list) and all(isinstance(o, str) for o in opts)):
            raise SystemExit(f"recipe {path}: stage {s.name!r} needs a list of strings (its options) or null")
        out[s.name] = opts
    return out


def stage_key(name: str, argv: list[str], upstream: str) -> str:
    """What makes a stage's output what it is: its options and the stages before it."""
    return hashlib.sha256(json.dumps([name, argv, upstream]).encode()).hexdigest()[:16]


def _meta(bundle_dir: Path) -> dict:
    f = bundle_dir / "bundle.json"
    return json.loads(f.read_text()) if f.exists() else {}


def _record(bundle_dir: Path, build: dict) -> None:
    """Write the build record into bundle.json (the stage just run saved the bundle without it, or with the old)."""
    meta = _meta(bundle_dir)
    build["minutes"] = round(sum(s.get("minutes", 0.0) for s in build["stages"].values()), 1)
    meta["build"] = build
    (bundle_dir / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    bundle_dir = out / "bundle"
    recipe = read_recipe(a.recipe)
    parser = argparse.ArgumentParser(prog="specrec")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for s in STAGES:
        s.command.add_parser(sub)
    build = dict(_meta(bundle_dir).get("build", {}))
    build.setdefault("stages", {})
    build["recipe"] = a.recipe
    upstream = json.dumps([a.data, a.protocol])
    t_all = time.time()
    stale = False  # an earlier stage runs: every later one is built again on what it makes
    for n, s in enumerate(STAGES, 1):
        opts = recipe[s.name]
        if opts is None:
            print(f"[build] {n}/{len(STAGES)} {s.name}: left out by the recipe", flush=True)
            continue
        argv = [*s.place(a, out), *opts]
        key = stage_key(s.name, argv, upstream)
        upstream = key
        rec = build["stages"].get(s.name, {})
        if not stale and rec.get("key") == key and s.done(bundle_dir, _meta(bundle_dir)):
            print(f"[build] {n}/{len(STAGES)} {s.name}: current ({rec.get('minutes', 0):.1f} min when built)",
                  flush=True)
            continue
        stale = True
        if s.name == "gr" and rec.get("key") not in (None, key):
            argv = [*argv, "--no-resume"]  # other options: the checkpoint is another run's (an interrupted one resumes)
        line = " ".join(["specrec", s.cmd, *argv])
        print(f"[build] {n}/{len(STAGES)} {s.name}: {line}", flush=True)
        if a.dry_run:
            continue
        # what this stage and the ones after it recorded no longer holds, whether or not this run finishes
        for later in STAGES[n - 1:]:
            build["stages"].pop(later.name, None)
        if (bundle_dir / "bundle.json").exists():
            _record(bundle_dir, build)
        t0 = time.time()
        args = parser.parse_args([s.cmd, *argv])
        status = int(args.func(args) or 0)
        if status:
            raise SystemExit(f"[build] stage {s.name} failed ({status}): {line}")
        build["stages"][s.name] = {"key": key, "argv": argv, "minutes": round((time.time() - t0) / 60.0, 2),
                                   "finished": datetime.now(UTC).isoformat(timespec="seconds")}
        _record(bundle_dir, build)
    if not a.dry_run:
        _record(bundle_dir, build)
        print(f"[build] {bundle_dir}: built in {build['minutes']:.1f} min over its stages "
              f"({(time.time() - t_all) / 60:.1f} min this run)", flush=True)
    return 0
