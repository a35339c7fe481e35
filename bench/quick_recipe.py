"""A newcomer's rebuild, timed: ``specrec build-bundle`` with a quick recipe on the shipped data, then the
bundle's lists on all test users (history excluded), the fused list against SASRec's own in the same bundle.

    python -m bench.quick_recipe --recipe recipes/beauty-quick.json --data data/beauty
    python -m bench.quick_recipe --recipe recipes/yelp-quick.json --data data/yelp

The build starts from nothing in ``--out`` (removed first unless ``--resume``): its minutes are
``build-bundle``'s own record (``bundle.json`` ``build``: minutes per stage and where each ran). The lists are
``specrec eval --policies beam,fused,drafter --k 10 --exclude-history`` over every test user (``--sample N`` for a
seeded sample), written to a scratch folder so that the served bundle's keys are untouched. Keys (``NAME`` the
recipe's file name with dots, e.g. ``beauty.quick``): ``NAME.build.minutes`` and ``NAME.build.<stage>.minutes``,
``NAME.loo.{fused,sasrec,beam,served}.excl.{recall,ndcg}@10`` (``served``: the list ``auto`` serves by default),
``NAME.loo.{fused,served}.excl.{recall,ndcg}_ratio_vs_sasrec`` (SASRec's list is the ``drafter`` policy's, the list
``fused`` ranks), the validation figures of the chosen models (``tune-fusion``'s, bundle.json ``fusion.valid``)
``NAME.loo.{fused,sasrec}.excl.valid.{recall,ndcg}@10`` and ``NAME.loo.fused.excl.valid_recall_ratio_vs_sasrec``,
``NAME.loo.fused.excl.valid_test_gap`` (|test ratio - validation ratio|), ``NAME.loo.default_is_fused`` and
``NAME.sids_from_interactions`` (1: the semantic IDs quantise the item embeddings a SASRec learnt, as on data
without item texts; 0: the items' texts). Results: ``quick_recipe_<recipe>.{json,md}``, or with a ``--name`` of
its own ``quick_recipe_<name, dots as dashes>``; ``--figures`` writes them again from a run's json; every build
in the results folder side by side in ``quick_recipe_builds.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.harness import ROOT, command_line, fmt, machine_line, publish, run_line, sayer
from specrec.eval.compare import valid_against_test

say = sayer("quick_recipe", clock=True)
#: key name -> the policy that makes that list (served: the list auto serves by default, without a deadline)
LISTS = {"fused": "fused", "sasrec": "drafter", "beam": "beam", "served": "auto"}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/beauty-quick.json")
    ap.add_argument("--data", default="data/beauty")
    ap.add_argument("--protocol", default="loo")
    ap.add_argument("--out", default=None, help="the build folder (default: runs/<recipe name>)")
    ap.add_argument("--name", default=None, help="the keys' prefix (default: the recipe's file name with dots, "
                    "e.g. beauty.quick)")
    ap.add_argument("--resume", action="store_true", help="go on from --out instead of building from nothing")
    ap.add_argument("--sample", type=int, default=None, help="test users (default: all)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--figures", default=None, metavar="JSON",
                    help="neither build nor evaluate: report again from the build record and evaluation a previous "
                    "run wrote (its quick_recipe_*.json), with the bundle in --out")
    return ap.parse_args(argv)


def results_name(recipe: Path, name: str) -> str:
    """The results' file name: the recipe's (``quick_recipe_beauty-quick``), or with a ``--name`` of its own the
    name's (``yelp_ids.quick`` -> ``quick_recipe_yelp_ids-quick``), so that two datasets built with one recipe do
    not overwrite each other's results."""
    default = recipe.stem.replace("-", ".")
    return f"quick_recipe_{recipe.stem if name == default else name.replace('.', '-')}"


def main(argv=None) -> int:
    a = parse(argv)
    recipe = Path(a.recipe)
    name = a.name or recipe.stem.replace("-", ".")
    out = Path(a.out or ROOT / "runs" / recipe.stem)
    if a.figures:
        prior = json.loads(Path(a.figures).read_text())
        return report(a, argv, recipe, name, out, prior["build"], prior["eval"], prior["wall_minutes"])
    if out.exists() and not a.resume:
        shutil.rmtree(out)
    spec = ["specrec", "build-bundle", "--data", a.data, "--protocol", a.protocol, "--out", str(out), "--recipe",
            str(recipe)]
    say(" ".join(spec))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specrec.cli", *spec[1:]], cwd=ROOT, check=True)
    wall = (time.perf_counter() - t0) / 60.0
    build = json.loads((out / "bundle" / "bundle.json").read_text())["build"]
    say(f"built in {build['minutes']:.1f} min by its record ({wall:.1f} min wall): "
        + ", ".join(f"{s} {r['minutes']:.1f}" for s, r in build["stages"].items()))
    scratch = Path(tempfile.mkdtemp(prefix="specrec-quick-"))
    ev = ["eval", "--bundle", str(out / "bundle"), "--policies", ",".join(LISTS.values()), "--k", "10",
          "--exclude-history", "--json", "--results-dir", str(scratch)]
    if a.sample:
        ev += ["--sample", str(a.sample), "--seed", "0"]
    res = subprocess.run([sys.executable, "-m", "specrec.cli", *ev], cwd=ROOT, check=True, stdout=subprocess.PIPE,
                         text=True)  # its progress on stderr, as it goes
    table = json.loads(res.stdout[res.stdout.index("{"):])
    return report(a, argv, recipe, name, out, build, table, wall)


def report(a, argv, recipe: Path, name: str, out: Path, build: dict, table: dict, wall: float) -> int:
    """The keys, table and results of one build (its record ``build``, ``wall`` minutes) and its evaluation
    (``table``: ``specrec eval --json``), its bundle in ``out``."""
    keys: dict = {f"{name}.build.minutes": build["minutes"]}
    for stage, rec in build["stages"].items():
        keys[f"{name}.build.{stage}.minutes"] = rec["minutes"]
    for key, policy in LISTS.items():
        overall = table["policies"][policy]["overall"]
        for m in ("recall@10", "ndcg@10"):
            keys[f"{name}.{a.protocol}.{key}.excl.{m}"] = overall[m]
    pre = f"{name}.{a.protocol}"
    for key in ("fused", "served"):  # against the bundle's own SASRec (the drafter's list)
        for m, ratio in (("recall@10", "recall_ratio_vs_sasrec"), ("ndcg@10", "ndcg_ratio_vs_sasrec")):
            own = keys[f"{pre}.sasrec.excl.{m}"]
            keys[f"{pre}.{key}.excl.{ratio}"] = keys[f"{pre}.{key}.excl.{m}"] / own if own else None
    meta = json.loads((out / "bundle" / "bundle.json").read_text())
    fusion = meta.get("fusion", {})
    default = fusion.get("default") or {}
    keys[f"{pre}.default_is_fused"] = None if not default else float(default["list"] == "fused")
    source = meta.get("sid_source", "text")  # what the semantic IDs quantise: the items' texts or the interactions
    keys[f"{name}.sids_from_interactions"] = float(source == "sasrec")
    # validation (the chosen models, tune-fusion's pair on the same users) beside test: specrec eval's own comparison,
    # made again from the bundle so that a re-report of an earlier run's figures carries today's (one place)
    lists = {p: SimpleNamespace(overall=r["overall"]) for p, r in table["policies"].items()}
    vt = table["valid_against_test"] = valid_against_test(fusion, lists, 10) or {}
    for m in ("recall@10", "ndcg@10"):
        row = vt.get(m, {})
        keys[f"{pre}.fused.excl.valid.{m}"], keys[f"{pre}.sasrec.excl.valid.{m}"] = (row.get("valid.fused"),
                                                                                   row.get("valid.drafter"))
    keys[f"{pre}.fused.excl.valid_recall_ratio_vs_sasrec"] = vt.get("recall@10", {}).get("valid.ratio")
    keys[f"{pre}.fused.excl.valid_test_gap"] = vt.get("recall@10", {}).get("gap")
    users = table["n"]
    md = [f"# {name}: a bundle rebuilt from the shipped data with {recipe}", "",
          f"`{command_line('bench.quick_recipe', argv)}`", "", f"{run_line()}; {machine_line(in_process=True)}.", "",
          "| stage | minutes | device |", "|---|---|---|"]
    md += [f"| {s} | {r['minutes']:.1f} | {r.get('device', 'cpu')} |" for s, r in build["stages"].items()]
    md += [f"| all | {build['minutes']:.1f} | |", "",
           f"All {users} test users, history excluded, K = 10 (`specrec eval --policies beam,fused,drafter "
           "--exclude-history`):", "", "| list | R@10 | N@10 |", "|---|---|---|"]
    md += [f"| {key} | {fmt(keys[f'{name}.{a.protocol}.{key}.excl.recall@10'], '.4f')} | "
           f"{fmt(keys[f'{name}.{a.protocol}.{key}.excl.ndcg@10'], '.4f')} |" for key in LISTS]
    md += ["", "Against the bundle's own SASRec (its `drafter` list), on validation users (the chosen models, "
           f"`tune-fusion`'s figures, both lists on {default.get('judged_on', 'the same users')}) and on test "
           "users (the served models" + (", refit on every interaction but the test ones: " + meta["refit"]["summary"]
                                        if meta.get("refit") else "") + "):", "",
           "| figure | validation | test |", "|---|---|---|",
           f"| fused / SASRec R@10 | {fmt(keys[f'{pre}.fused.excl.valid_recall_ratio_vs_sasrec'], '.3f')} | "
           f"{fmt(keys[f'{pre}.fused.excl.recall_ratio_vs_sasrec'], '.3f')} |",
           "| served (auto's default list) / SASRec R@10 | | "
           f"{fmt(keys[f'{pre}.served.excl.recall_ratio_vs_sasrec'], '.3f')} |",
           f"| served / SASRec N@10 | | {fmt(keys[f'{pre}.served.excl.ndcg_ratio_vs_sasrec'], '.3f')} |", "",
           f"valid_test_gap (fused/SASRec R@10, |test - validation|): "
           f"**{fmt(keys[f'{pre}.fused.excl.valid_test_gap'], '.3f')}**", "",
           f"auto's default list: `{default.get('list', 'not decided')}`"
           + (f" ({default['why']})" if default else ""), "",
           f"Semantic IDs from: `{source}` ({json.dumps(meta.get('sid_source_info'))})"]
    if a.figures:
        md[4] += (f" Reported again from `{a.figures}`: this line is the report's; the build and its evaluation "
                  "ran before.")
    publish(Path(a.results), results_name(recipe, name), {"build": build, "eval": table, "keys": keys,
                                                            "wall_minutes": wall}, "\n".join(md) + "\n", keys)
    plot_builds(Path(a.results))
    print("\n".join(md))
    return 0


def plot_builds(results: Path) -> Path:
    """Every quick build's results in ``results`` side by side (``quick_recipe_builds.png``): its fused list over
    its SASRec's R@10 on validation and on test, and the served list's on test, against the bar at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = []
    for path in sorted(results.glob("quick_recipe_*.json")):
        keys = json.loads(path.read_text())["keys"]
        name = path.stem.removeprefix("quick_recipe_").replace("-", ".")  # results_name's, read back
        pre = f"{name}.loo"
        rows.append((name, [keys.get(f"{pre}.fused.excl.valid_recall_ratio_vs_sasrec"),
                            keys.get(f"{pre}.fused.excl.recall_ratio_vs_sasrec"),
                            keys.get(f"{pre}.served.excl.recall_ratio_vs_sasrec")]))
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    x = np.arange(len(rows))
    for i, (label, color) in enumerate((("fused, validation", "tab:blue"), ("fused, test", "tab:red"),
                                        ("served, test", "tab:green"))):
        vals = [np.nan if r[1][i] is None else r[1][i] for r in rows]
        bars = ax.bar(x + (i - 1) * 0.27, vals, 0.27, color=color, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [r[0] for r in rows])
    ax.set_ylabel("R@10 / the bundle's SASRec's R@10")
    top = max([v for r in rows for v in r[1] if v is not None] + [1.0])
    ax.set_ylim(0.8, top + 0.08)
    ax.set_title("Quick builds: validation (the chosen models) against test (the refit ones)")
    ax.legend(fontsize=8, loc="upper center", ncols=3)
    fig.tight_layout()
    path = results / "quick_recipe_builds.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
