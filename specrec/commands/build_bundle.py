"""``specrec build-bundle``: one command from a dataset to a served bundle.

The stages are the commands a bundle was built with by hand, run in order on ``OUT/bundle``, each with the
options a recipe gives it (a JSON file: stage name -> that command's options; a stage left out runs with the
command's defaults, a stage set to ``null`` is not built):

    gr        specrec train           split, semantic IDs, the GR model (resumes from its checkpoint in OUT)
    sasrec    specrec train-baseline  the SASRec baseline (the item drafter of ``fused`` and ``drafter``)
    drafters  specrec train-drafters  the retrieval drafter, self-draft and NEZHA heads, the distilled drafter
    fusion    specrec tune-fusion     how ``fused`` weighs both models and which list ``auto`` serves by default,
                                      chosen on validation users
    refit     specrec refit           the GR and SASRec trained again on every interaction but the test ones, every
                                      choice kept (the production protocol, :mod:`specrec.train.refit`)
    graphs    specrec export-onnx     the verifier's ONNX graphs and their precisions on this machine

A stage is skipped when it is current: ``bundle.json`` (``build.stages``) records, per stage, a key of its own
options and of the keys of the stages before it, and its outputs are there. So a re-run after an interruption
goes on where it stopped, and a change of one stage's options rebuilds that stage and every one after it.

OUT is the build folder, and everything a later run reads is in it: the bundle, each finished stage's record,
the GR's last checkpoint (in parts of at most 16 MiB, ``--checkpoint-part-mib``; removed once the stage is
done, its weights being in the bundle) and the stage under way (``build-running.json``). Put it where git keeps
it (``bundles/builds/NAME``; ``runs/`` is ignored) and a build cut short on one machine, a GPU machine that
stops at 10 minutes say, goes on on another after a commit, never running a finished stage again. The ONNX
graphs are the exception: they are not committed (``*.onnx``) and are this machine's, so ``graphs`` runs where
they are missing.

``--device cuda`` trains every training stage on a GPU (and scores tune-fusion's users there); export-onnx
runs on the CPU. ``--batch-scale K`` multiplies each training stage's batch by K (learning rate by sqrt(K),
:mod:`specrec.train.device`); it is part of the stages' keys, the device is not. ``build.stages.<name>`` keeps
the minutes each stage took over all its sessions (a session cut short included: ``minutes`` is kept up to
date while a stage runs), the device of each session and the stage's ``device``; ``build.minutes`` their sum
(``specrec eval`` reports it as ``<dataset>.build.minutes``).

    specrec build-bundle --data data/beauty --out bundles/builds/beauty-loo --recipe recipes/beauty-loo.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

from . import export_onnx, refit, train, train_baseline, train_drafters, tune_fusion
from .options import add_device_args, training_device

#: a checkpoint part, at most: a GPU machine returns files of at most 16 MiB
PART_MIB = 16
#: the stage under way, beside the bundle: its key and its sessions so far
RUNNING = "build-running.json"
#: seconds between updates of the running stage's minutes (a session cut short loses at most this)
HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class BuildStage:
    name: str
    cmd: str  # its ``specrec`` subcommand
    command: ModuleType  # that subcommand's module of specrec.commands: add_parser(sub), run(args)
    place: Callable[[argparse.Namespace, Path], list[str]]  # the options that say where: data, out, bundle
    done: Callable[[Path, dict], bool]  # its outputs are in the bundle (directory, bundle.json)
    trains: bool = False  # takes --device and --batch-scale
    on_device: bool = False  # takes --device (tune-fusion's scoring)


def _drafters_done(b: Path, meta: dict) -> bool:
    files = {"retrieval": "retrieval.safetensors", "self": "self_draft.safetensors",
             "nezha": "nezha_head.safetensors", "distill": "sid_mlp.safetensors"}
    stage = meta.get("build", {}).get("stages", {}).get("drafters", {})
    which = _option(stage.get("argv", []), "--which", "retrieval,self,nezha")
    return all((b / files[w.strip()]).exists() for w in which.split(",") if w.strip() in files)


def _graphs_done(b: Path, meta: dict) -> bool:
    """The graphs are there: their config and the graphs themselves (not committed, so not on a new machine)."""
    return (b / "onnx" / "config.json").exists() and any((b / "onnx").glob("*.onnx"))


def _option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


STAGES: tuple[BuildStage, ...] = (
    BuildStage("gr", "train", train, lambda a, out: ["--data", a.data, "--protocol", a.protocol, "--out", str(out)],
               lambda b, meta: (b / "model.safetensors").exists(), trains=True),
    BuildStage("sasrec", "train-baseline", train_baseline, lambda a, out: ["--bundle", str(out / "bundle")],
               lambda b, meta: (b / "sasrec.safetensors").exists(), trains=True),
    BuildStage("drafters", "train-drafters", train_drafters, lambda a, out: ["--bundle", str(out / "bundle")],
               _drafters_done, trains=True),
    BuildStage("fusion", "tune-fusion", tune_fusion, lambda a, out: ["--bundle", str(out / "bundle")],
               lambda b, meta: bool(meta.get("fusion")), on_device=True),
    BuildStage("refit", "refit", refit,
               lambda a, out: ["--bundle", str(out / "bundle"), "--run-dir", str(out / "refit"), "--keep-chosen",
                               str(out / "chosen")],
               lambda b, meta: bool(meta.get("refit")), on_device=True),
    BuildStage("graphs", "export-onnx", export_onnx, lambda a, out: ["--bundle", str(out / "bundle")],
               _graphs_done),
)


#: the refit stage's place: the stages before it choose on validation users, so they never run on refit models
REFIT = next(i for i, s in enumerate(STAGES) if s.name == "refit")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-bundle", help="build a served bundle from a dataset in one command (every stage, "
                       "each skipped when current)", description=(__doc__ or "").split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic", help="dataset directory or 'synthetic'")
    p.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    p.add_argument("--out", required=True, help="the build folder: OUT/bundle, the GR's checkpoint and logs (under "
                   "bundles/builds/ to commit it, so that another machine goes on with it)")
    p.add_argument("--recipe", help="JSON file: stage -> that command's options (a list of strings), or null to "
                   f"leave the stage out; stages: {', '.join(s.name for s in STAGES)}")
    g = p.add_argument_group("where the stages run (the device is not part of a stage's key)")
    add_device_args(g)
    g.add_argument("--checkpoint-minutes", type=float, default=None,
                   help="the GR's checkpoint interval (default: specrec train's, every epoch on the CPU and every "
                   "2 minutes on a GPU)")
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


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


class Session:
    """One run of a stage: its device and minutes, kept in ``OUT/build-running.json`` with the stage's earlier
    sessions (of the same key) while it runs, so that a session cut short still counts."""

    def __init__(self, out: Path, stage: str, key: str, device: str):
        self.path = out / RUNNING
        out.mkdir(parents=True, exist_ok=True)
        running = json.loads(self.path.read_text()) if self.path.exists() else {}
        same = running.get("stage") == stage and running.get("key") == key
        self.state = {"stage": stage, "key": key, "sessions": running.get("sessions", []) if same else []}
        self.mine = {"device": device, "started": datetime.now(UTC).isoformat(timespec="seconds"), "minutes": 0.0}
        self.state["sessions"].append(self.mine)
        self.t0 = time.time()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._save()
        self.beat = threading.Thread(target=self._heartbeat, name="build-heartbeat", daemon=True)
        self.beat.start()

    def _save(self) -> None:
        with self.lock:
            self.mine["minutes"] = round((time.time() - self.t0) / 60.0, 2)
            _write_json(self.path, self.state)

    def _heartbeat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self._save()

    def finish(self) -> dict:
        """Stop counting -> the stage's record: minutes over its sessions, their devices."""
        self.stop.set()
        self.beat.join()
        self._save()
        sessions = self.state["sessions"]
        self.path.unlink(missing_ok=True)
        devices = list(dict.fromkeys(s["device"] for s in sessions))
        return {"minutes": round(sum(s["minutes"] for s in sessions), 2), "device": ", ".join(devices),
                "sessions": sessions}

    def abandon(self) -> None:
        self.stop.set()
        self.beat.join()
        self._save()


def _how(s: BuildStage, a: argparse.Namespace, device: str) -> list[str]:
    """The options that say where and how a stage runs, not what it makes (outside its key)."""
    if s.name == "gr":
        every = [] if a.checkpoint_minutes is None else ["--checkpoint-minutes", str(a.checkpoint_minutes)]
        return ["--device", device, *every, "--checkpoint-part-mib", str(PART_MIB)]
    return ["--device", device] if s.trains or s.on_device else []


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    bundle_dir = out / "bundle"
    recipe = read_recipe(a.recipe)
    device = training_device(a)
    parser = argparse.ArgumentParser(prog="specrec")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for s in STAGES:
        s.command.add_parser(sub)
    build = dict(_meta(bundle_dir).get("build", {}))
    build.setdefault("stages", {})
    build["recipe"] = a.recipe
    running = json.loads((out / RUNNING).read_text()) if (out / RUNNING).exists() else {}
    upstream = json.dumps([a.data, a.protocol])
    t_all = time.time()
    stale = False  # an earlier stage runs: every later one is built again on what it makes
    for n, s in enumerate(STAGES, 1):
        opts = recipe[s.name]
        if opts is None:
            print(f"[build] {n}/{len(STAGES)} {s.name}: left out by the recipe", flush=True)
            continue
        scale = ["--batch-scale", f"{a.batch_scale:g}"] if s.trains and a.batch_scale != 1 else []
        argv = [*s.place(a, out), *scale, *opts]  # what it makes: the key
        key = stage_key(s.name, argv, upstream)
        upstream = key
        rec = build["stages"].get(s.name, {})
        if not stale and rec.get("key") == key and s.done(bundle_dir, _meta(bundle_dir)):
            print(f"[build] {n}/{len(STAGES)} {s.name}: current ({rec.get('minutes', 0):.1f} min when built"
                  + (f", on {rec['device']})" if rec.get("device") else ")"), flush=True)
            continue
        stale = True
        if n - 1 < REFIT and _meta(bundle_dir).get("refit") and s.name != "gr":
            raise SystemExit(f"[build] stage {s.name} would run on models already refit on the validation targets "
                             f"(bundle.json `refit`), where no validation user can judge a choice: build from the "
                             f"gr stage again (remove {out} or change the gr stage's options)")
        where = "cpu" if not (s.trains or s.on_device) else device
        argv = [*s.place(a, out), *_how(s, a, where), *scale, *opts]
        # the GR's checkpoint belongs to the run of its key: another key's run starts afresh
        before = rec.get("key") or (running.get("key") if running.get("stage") == s.name else None)
        if s.name == "gr" and before not in (None, key):
            argv = [*argv, "--no-resume"]
        line = " ".join(["specrec", s.cmd, *argv])
        print(f"[build] {n}/{len(STAGES)} {s.name}: {line}", flush=True)
        if a.dry_run:
            continue
        # what this stage and the ones after it recorded no longer holds, whether or not this run finishes
        for later in STAGES[n - 1:]:
            build["stages"].pop(later.name, None)
        if (bundle_dir / "bundle.json").exists():
            _record(bundle_dir, build)
        session = Session(out, s.name, key, where)
        try:
            args = parser.parse_args([s.cmd, *argv])
            status = int(args.func(args) or 0)
        except BaseException:
            session.abandon()  # its minutes so far stay in build-running.json for the run that goes on
            raise
        if status:
            session.abandon()
            raise SystemExit(f"[build] stage {s.name} failed ({status}): {line}")
        build["stages"][s.name] = {"key": key, "argv": argv, **session.finish(),
                                   "finished": datetime.now(UTC).isoformat(timespec="seconds")}
        _record(bundle_dir, build)
        if s.name == "gr":
            _drop_checkpoint(out)
    if not a.dry_run:
        _record(bundle_dir, build)
        print(f"[build] {bundle_dir}: built in {build['minutes']:.1f} min over its stages "
              f"({(time.time() - t_all) / 60:.1f} min this run)", flush=True)
    return 0


def _drop_checkpoint(out: Path) -> None:
    """The GR stage is done and its weights are in the bundle: its checkpoint (tens of MB, in parts) goes."""
    from ..train import checkpoint as ckpt

    names = [out / "checkpoint.pt", out / "best_model.pt"]
    files = [f for name in names for f in ckpt.files(name)]
    mib = sum(f.stat().st_size for f in files) / ckpt.MIB
    for name in names:
        ckpt.remove(name)
    if files:
        print(f"[build] gr: done, its weights in the bundle; its checkpoint removed ({len(files)} files, "
              f"{mib:.0f} MiB)", flush=True)
