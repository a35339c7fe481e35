"""The production protocol (``specrec refit``, the build's ``refit`` stage): once every choice was made on validation
users, the GR and SASRec are trained again on every interaction but the test ones, the choices kept; nothing
chooses on the refit models afterwards."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specrec.data import synthetic_dataset
from specrec.data.splits import leave_one_out, refit_split, temporal
from specrec.train.batches import causal_chunks

from .test_build_bundle import TINY_GR, TINY_SASREC


def test_the_refit_split_trains_on_the_validation_targets_and_keeps_the_test_examples():
    ds = synthetic_dataset(n_items=120, n_users=150, seed=2)
    for split in (leave_one_out(ds, 8), temporal(ds, 8)):
        full = refit_split(split)
        assert len(full.train) == len(split.train) + len(split.valid) and len(full.valid) == 0
        assert np.array_equal(full.test.target, split.test.target)
        assert np.array_equal(full.test.history, split.test.history)
        assert (full.seen >= split.seen).all()
        taught = {(u, p) for u, p in zip(full.train.user.tolist(), full.train.position.tolist())}
        assert {(u, p) for u, p in zip(split.valid.user.tolist(), split.valid.position.tolist())} <= taught
    # leave-one-out: a test history ends with the validation target, now a training target the causal chunks
    # teach (and the history of no example but the test one)
    split = leave_one_out(ds, 8)
    full = refit_split(split)
    inp, tgt = causal_chunks(full.train, 5)
    assert sorted(tgt[tgt >= 0].tolist()) == sorted(full.train.target.tolist())
    last_valid = {int(u): int(t) for u, t in zip(split.valid.user, split.valid.target)}
    for u, h in zip(split.test.user.tolist(), split.test.history):
        assert h[-1] == last_valid[u]


def _build(tmp_path, recipe: dict) -> None:
    from specrec.cli import main

    f = tmp_path / "recipe.json"
    f.write_text(json.dumps(recipe))
    assert main(["build-bundle", "--data", "synthetic", "--protocol", "loo", "--out", str(tmp_path / "run"),
                 "--recipe", str(f)]) == 0


@pytest.mark.slow
def test_refit_trains_both_models_again_on_the_validation_targets_and_nothing_chooses_on_them_after(tmp_path):
    from specrec.bundle import Bundle
    from specrec.train.refit import refit

    fusion = ["--users", "80", "--drafts", "20", "--combiner-hidden", "4"]
    recipe = {"gr": TINY_GR, "sasrec": TINY_SASREC, "drafters": None, "fusion": fusion, "refit": None, "graphs": None}
    _build(tmp_path, recipe)
    chosen_dir = tmp_path / "run" / "bundle"
    chosen = Bundle.load(chosen_dir)
    decided = chosen.meta["fusion"]["default"]  # tune-fusion's decision, with its figures and reason
    assert decided["list"] in ("fused", "drafter") and decided["users"] in (80, 40) and decided["why"]  # 40: a combiner
    assert chosen.fusion is not None and chosen.fusion.default == decided["list"]
    r = decided["recall@10"]
    assert r["diff_lo"] <= r["diff"] <= r["diff_hi"] and (decided["list"] == "fused") == (r["diff_lo"] > 0)
    for mode in ("retrain", "continue"):
        d = tmp_path / mode / "bundle"
        shutil.copytree(chosen_dir, d)
        rec = refit(d, tmp_path / mode / "refit", mode, gr_epochs=1, sasrec_epochs=1, progress=False,
                    log=lambda s: None)
        b = Bundle.load(d)
        assert b.meta["refit"] == rec and rec["mode"] == mode
        assert rec["targets"] == chosen.meta["split"]["train"] + chosen.meta["split"]["valid"]
        assert rec["added_validation_targets"] == chosen.meta["split"]["valid"]
        for mine, theirs in ((b.model, chosen.model), (b.sasrec, chosen.sasrec)):
            assert any(not torch.equal(p, q) for p, q in zip(mine.state_dict().values(),
                                                              theirs.state_dict().values()))
        assert np.array_equal(b.sids, chosen.sids) and b.meta.get("train") == chosen.meta.get("train")
        assert not (tmp_path / mode / "refit").exists()  # its checkpoints go once the weights are in the bundle
        with pytest.raises(SystemExit, match="refit already"):
            refit(d, tmp_path / mode / "refit", mode, progress=False, log=lambda s: None)
    assert Bundle.load(tmp_path / "retrain" / "bundle").meta["refit"]["gr"]["mirrors_epoch"] == 1

    # nothing chooses on refit models: tune-fusion, `specrec eval --split valid`, and a build whose earlier stage
    # would run again on them
    from specrec.cli import main
    from specrec.train.fusion import tune_fusion

    with pytest.raises(SystemExit, match="refit on the validation targets"):
        tune_fusion(tmp_path / "retrain" / "bundle", users=20, progress=False)
    with pytest.raises(SystemExit, match="refit on the validation targets"):
        main(["eval", "--bundle", str(tmp_path / "retrain" / "bundle"), "--split", "valid", "--ranker", "sasrec"])
    _build(tmp_path, {**recipe, "refit": ["--mode", "continue", "--gr-epochs", "1", "--sasrec-epochs", "1"]})
    built = json.loads((chosen_dir / "bundle.json").read_text())
    assert built["refit"]["mode"] == "continue" and "refit" in built["build"]["stages"]
    kept = Bundle.load(tmp_path / "run" / "chosen")  # the chosen models, kept beside the refit bundle
    assert "refit" not in kept.meta and "train" in kept.meta
    assert all(torch.equal(p, q) for p, q in zip(kept.model.state_dict().values(), chosen.model.state_dict().values()))
    assert kept.data_path is not None and Bundle.load(chosen_dir).data_path == kept.data_path
    with pytest.raises(SystemExit, match="already refit"):
        _build(tmp_path, {**recipe, "sasrec": [*TINY_SASREC, "--dropout", "0.2"], "refit": []})
