"""``specrec build-bundle``: every stage in order, each skipped when current, a changed stage rebuilt with every
stage after it, the minutes per stage in bundle.json."""

import json
from pathlib import Path

import pytest

from specrec.cli import main

ROOT = Path(__file__).resolve().parents[2]

TINY_GR = ["--codebook-size", "16", "--levels", "2", "--collision-size", "64", "--d-model", "32", "--heads", "2",
           "--d-kv", "16", "--d-ff", "64", "--enc-layers", "1", "--dec-layers", "1", "--max-history", "8",
           "--causal-encoder", "--epochs", "1", "--batch-size", "64", "--valid-limit", "50"]
TINY_SASREC = ["--d-model", "16", "--epochs", "1", "--valid-limit", "50"]


def _build(tmp_path, capsys, recipe: dict) -> tuple[dict, str]:
    f = tmp_path / "recipe.json"
    f.write_text(json.dumps(recipe))
    assert main(["build-bundle", "--data", "synthetic", "--protocol", "temporal", "--out", str(tmp_path / "run"),
                 "--recipe", str(f)]) == 0
    said = capsys.readouterr().out
    return json.loads((tmp_path / "run" / "bundle" / "bundle.json").read_text())["build"], said


@pytest.mark.slow
def test_stages_run_once_and_a_changed_stage_rebuilds_itself_and_what_follows(tmp_path, capsys):
    recipe = {"gr": TINY_GR, "sasrec": TINY_SASREC, "drafters": None, "fusion": None, "refit": None, "graphs": None}
    first, said = _build(tmp_path, capsys, recipe)
    assert "gr: specrec train" in said and "sasrec: specrec train-baseline" in said
    assert "drafters: left out by the recipe" in said
    assert set(first["stages"]) == {"gr", "sasrec"}
    assert first["minutes"] == round(sum(s["minutes"] for s in first["stages"].values()), 1)
    model = tmp_path / "run" / "bundle" / "model.safetensors"
    stamp = model.stat().st_mtime_ns

    again, said = _build(tmp_path, capsys, recipe)
    assert "gr: current" in said and "sasrec: current" in said and "specrec train" not in said
    assert again["stages"] == first["stages"] and model.stat().st_mtime_ns == stamp

    changed, said = _build(tmp_path, capsys, {**recipe, "sasrec": [*TINY_SASREC, "--dropout", "0.2"]})
    assert "gr: current" in said and "sasrec: specrec train-baseline" in said
    assert changed["stages"]["gr"] == first["stages"]["gr"]
    assert changed["stages"]["sasrec"]["key"] != first["stages"]["sasrec"]["key"]

    # the GR's options changed: trained afresh (not resumed from the other run's checkpoint), then what follows
    regr, said = _build(tmp_path, capsys, {**recipe, "gr": [*TINY_GR, "--dropout", "0.2"]})
    assert "gr: specrec train" in said and "--no-resume" in said and "sasrec: specrec train-baseline" in said
    assert regr["stages"]["gr"]["key"] != first["stages"]["gr"]["key"] and model.stat().st_mtime_ns != stamp


def test_a_recipe_naming_an_unknown_stage_or_options_that_are_not_strings_is_refused(tmp_path):
    from specrec.commands.build_bundle import read_recipe

    f = tmp_path / "r.json"
    f.write_text(json.dumps({"gr": [], "sasrek": []}))
    with pytest.raises(SystemExit, match="unknown stages"):
        read_recipe(str(f))
    f.write_text(json.dumps({"fusion": ["--drafts", 40]}))
    with pytest.raises(SystemExit, match="list of strings"):
        read_recipe(str(f))
    assert read_recipe(None)["graphs"] == []


class Cut(Exception):
    """The machine went away."""


@pytest.mark.slow
def test_a_build_cut_short_goes_on_where_it_stopped_and_records_each_stages_minutes_and_device(tmp_path, capsys,
                                                                                               monkeypatch):
    """A build cut in the middle of the GR's training, then in the middle of SASRec's: each run goes on from what
    the build folder holds (the GR from its checkpoint, at the step it saved), never running a finished stage
    again; every session's minutes and device are in bundle.json."""
    import torch

    from specrec.commands import train_baseline
    from specrec.train import checkpoint as ckpt

    out = tmp_path / "run"
    f = tmp_path / "recipe.json"
    f.write_text(json.dumps({"gr": TINY_GR, "sasrec": TINY_SASREC, "drafters": None, "fusion": None, "refit": None,
                             "graphs": None}))
    argv = ["build-bundle", "--data", "synthetic", "--protocol", "temporal", "--out", str(out), "--recipe", str(f),
            "--device", "cpu", "--checkpoint-minutes", "0"]
    real_step = torch.optim.AdamW.step
    calls = [0]

    def cut_at_fourth(self, *a, **k):
        calls[0] += 1
        if calls[0] == 4:
            raise Cut
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", cut_at_fourth)
    with pytest.raises(Cut):
        main(argv)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    running = json.loads((out / "build-running.json").read_text())
    assert running["stage"] == "gr" and [s["device"] for s in running["sessions"]] == ["cpu"]
    assert ckpt.load(out / "checkpoint.pt")["step"] == 3
    capsys.readouterr()

    def machine_goes_away(args):
        raise Cut

    monkeypatch.setattr(train_baseline, "run", machine_goes_away)
    with pytest.raises(Cut):
        main(argv)
    said = capsys.readouterr().out
    assert "gr: specrec train" in said and "--no-resume" not in said and "resumed from" in said
    assert "at epoch 0, step 3 (3 batches into epoch 1)" in said  # not from scratch
    gr = json.loads((out / "bundle" / "bundle.json").read_text())["build"]["stages"]["gr"]
    assert gr["device"] == "cpu" and len(gr["sessions"]) == 2
    assert gr["minutes"] == round(sum(s["minutes"] for s in gr["sessions"]), 2)
    assert "--device" in gr["argv"] and "--checkpoint-part-mib" in gr["argv"]
    assert not ckpt.exists(out / "checkpoint.pt") and not ckpt.exists(out / "best_model.pt")  # in the bundle now
    assert json.loads((out / "build-running.json").read_text())["stage"] == "sasrec"

    monkeypatch.undo()
    build, said = _build_again(argv, out, capsys)
    assert "gr: current" in said and "on cpu" in said and "sasrec: specrec train-baseline" in said
    assert "specrec train " not in said
    assert build["stages"]["gr"] == gr and len(build["stages"]["sasrec"]["sessions"]) == 2  # the cut one counts
    assert build["stages"]["sasrec"]["device"] == "cpu"
    assert build["minutes"] == round(sum(s["minutes"] for s in build["stages"].values()), 1)
    assert not (out / "build-running.json").exists()

    # a bigger batch changes what the training stages make (their keys); the device would not
    assert main([*argv, "--batch-scale", "2", "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "gr: specrec train" in said and "--batch-scale 2" in said


def _build_again(argv: list[str], out, capsys) -> tuple[dict, str]:
    assert main(argv) == 0
    said = capsys.readouterr().out
    return json.loads((out / "bundle" / "bundle.json").read_text())["build"], said


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.json")), ids=lambda p: p.name)
def test_every_committed_recipe_gives_each_stage_options_its_command_takes(recipe):
    """A typo in a recipe fails here, not minutes into a build (``specrec stack up`` builds from one)."""
    import argparse

    from specrec.commands.build_bundle import STAGES, read_recipe

    parser = argparse.ArgumentParser(prog="specrec", exit_on_error=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for s in STAGES:
        s.command.add_parser(sub)
    fake = argparse.Namespace(data="synthetic", protocol="temporal")
    for s in STAGES:
        opts = read_recipe(str(recipe))[s.name]
        if opts is not None:
            args = parser.parse_args([s.cmd, *s.place(fake, ROOT / "runs" / "x"), *opts])
            assert args.cmd == s.cmd


def test_the_local_stack_recipe_is_the_small_model_it_was():
    """``specrec stack up``'s synthetic bundle (``recipes/synthetic-stack.json``): the model it built before its
    options moved to a recipe."""
    import argparse

    from specrec.commands import train
    from specrec.commands.build_bundle import read_recipe

    parser = argparse.ArgumentParser(prog="specrec")
    train.add_parser(parser.add_subparsers(dest="cmd"))
    a = parser.parse_args(["train", "--out", "x", *read_recipe(str(ROOT / "recipes" / "synthetic-stack.json"))["gr"]])
    assert [a.codebook_size] * a.levels + [a.collision_size] == [32, 32, 32, 64]
    assert (a.d_model, a.heads, a.d_kv, a.d_ff, a.enc_layers, a.dec_layers, a.max_history) == (64, 4, 16, 256, 2, 2, 20)
    assert (a.epochs, a.warmup_steps, a.valid_limit) == (8, 50, 500)
