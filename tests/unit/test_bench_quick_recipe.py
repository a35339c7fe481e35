"""bench.quick_recipe's report: where its results go and the keys it derives from a build and its evaluation."""

import json
from pathlib import Path

from bench import quick_recipe


def test_results_name_keeps_the_recipe_name_and_separates_a_name_of_its_own():
    recipe = Path("recipes/yelp-quick.json")
    assert quick_recipe.results_name(recipe, "yelp.quick") == "quick_recipe_yelp-quick"
    # the same recipe on a copy of the data without texts must not overwrite Yelp's results
    assert quick_recipe.results_name(recipe, "yelp_ids.quick") == "quick_recipe_yelp_ids-quick"
    assert quick_recipe.results_name(recipe, "yelp.quick.e0") == "quick_recipe_yelp-quick-e0"


def _table(users: int, lists: dict[str, tuple[float, float]]) -> dict:
    return {"n": users, "policies": {p: {"overall": {"recall@10": r, "ndcg@10": n}} for p, (r, n) in lists.items()}}


def test_report_from_a_previous_runs_figures(tmp_path):
    out, results = tmp_path / "build", tmp_path / "results"
    (out / "bundle").mkdir(parents=True)
    build = {"minutes": 70.0, "stages": {"gr": {"minutes": 30.0, "device": "cpu"}, "fusion": {"minutes": 40.0}}}
    meta = {"build": build, "sid_source": "sasrec", "sid_source_info": {"model": "sasrec"},
            "fusion": {"default": {"list": "fused", "why": "above 0"},
                       "valid": {"fused": {"recall@10": 0.044, "ndcg@10": 0.022},
                                 "drafter": {"recall@10": 0.040, "ndcg@10": 0.020}}}}
    (out / "bundle" / "bundle.json").write_text(json.dumps(meta))
    table = _table(100, {"fused": (0.042, 0.021), "drafter": (0.040, 0.020), "beam": (0.01, 0.005),
                         "auto": (0.042, 0.021)})
    prior = tmp_path / "prior.json"  # its eval's comparison as an older specrec eval wrote it: replaced, not kept
    stale = {**table, "valid_against_test": {"recall@10": {"valid.ratio": 1.073, "gap": 0.059}}}
    prior.write_text(json.dumps({"build": build, "eval": stale, "keys": {}, "wall_minutes": 71.0}))
    rc = quick_recipe.main(["--recipe", "recipes/yelp-quick.json", "--out", str(out), "--name", "yelp_ids.quick",
                            "--results", str(results), "--figures", str(prior)])
    assert rc == 0
    assert not (results / "quick_recipe_yelp-quick.json").exists()
    keys = json.loads((results / "quick_recipe_yelp_ids-quick.json").read_text())["keys"]
    assert keys["yelp_ids.quick.build.minutes"] == 70.0
    assert keys["yelp_ids.quick.sids_from_interactions"] == 1.0
    assert keys["yelp_ids.quick.loo.default_is_fused"] == 1.0
    assert abs(keys["yelp_ids.quick.loo.served.excl.recall_ratio_vs_sasrec"] - 1.05) < 1e-9
    assert abs(keys["yelp_ids.quick.loo.fused.excl.valid_test_gap"] - abs(1.05 - 1.1)) < 1e-9
    written = json.loads((results / "quick_recipe_yelp_ids-quick.json").read_text())["eval"]["valid_against_test"]
    assert written["recall@10"]["gap"] == keys["yelp_ids.quick.loo.fused.excl.valid_test_gap"]  # one source
    md = (results / "quick_recipe_yelp_ids-quick.md").read_text()
    assert f"Reported again from `{prior}`" in md and "Semantic IDs from: `sasrec`" in md
    assert (results / "quick_recipe_builds.png").stat().st_size > 0  # every build in the results, side by side
    # a name with more dots beside it: the plot reads each build's name back from its file
    assert quick_recipe.main(["--recipe", "recipes/yelp-quick.json", "--out", str(out), "--name", "yelp.quick.e0",
                              "--results", str(results), "--figures", str(prior)]) == 0
    assert (results / "quick_recipe_yelp-quick-e0.json").exists()
    summary = json.loads((results / "summary.json").read_text())
    assert summary["yelp_ids.quick.loo.fused.excl.recall@10"] == 0.042
