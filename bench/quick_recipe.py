"""A newcomer's rebuild, timed: ``specrec build-bundle`` with a quick recipe on the shipped data, then the
bundle's lists on all test users (history excluded), the fused list against SASRec's own in the same bundle.

    python -m bench.quick_recipe --recipe recipes/beauty-quick.json --data data/beauty
    python -m bench.quick_recipe --recipe recipes/yelp-quick.json --data data/yelp

The build starts from nothing in ``--out`` (removed first unless ``--resume``): its minutes are
``build-bundle``'s own record (``bundle.json`` ``build``: minutes per stage and where each ran). The lists are
``specrec eval --policies beam,fused,drafter --k 10 --exclude-history`` over every test user (``--sample N`` for a
seeded sample), written to a scratch folder so that the served bundle's keys are untouched. Keys (``NAME`` the
recipe's file name with dots, e.g. ``beauty.quick``): ``NAME.build.minutes`` and ``NAME.build.<stage>.minutes``,
``NAME.loo.{fused,sasrec,beam}.excl.{recall,ndcg}@10`` and ``NAME.loo.fused.excl.recall_ratio_vs_sasrec``
(SASRec's list is the ``drafter`` policy's, the list ``fused`` ranks).
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

from bench.harness import ROOT, command_line, fmt, machine_line, publish, run_line, sayer

say = sayer("quick_recipe", clock=True)
LISTS = {"fused": "fused", "sasrec": "drafter", "beam": "beam"}  # key name -> the policy that makes that list


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/beauty-quick.json")
    ap.add_argument("--data", default="data/beauty")
    ap.add_argument("--protocol", default="loo")
    ap.add_argument("--out", default=None, help="the build folder (default: runs/<recipe name>)")
    ap.add_argument("--resume", action="store_true", help="go on from --out instead of building from nothing")
    ap.add_argument("--sample", type=int, default=None, help="test users (default: all)")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    recipe = Path(a.recipe)
    name = recipe.stem.replace("-", ".")
    out = Path(a.out or ROOT / "runs" / recipe.stem)
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
    ev = ["eval", "--bundle", str(out / "bundle"), "--policies", "beam,fused,drafter", "--k", "10",
          "--exclude-history", "--json", "--results-dir", str(scratch)]
    if a.sample:
        ev += ["--sample", str(a.sample), "--seed", "0"]
    res = subprocess.run([sys.executable, "-m", "specrec.cli", *ev], cwd=ROOT, check=True, capture_output=True,
                         text=True)
    table = json.loads(res.stdout[res.stdout.index("{"):])
    keys: dict = {f"{name}.build.minutes": build["minutes"]}
    for stage, rec in build["stages"].items():
        keys[f"{name}.build.{stage}.minutes"] = rec["minutes"]
    for key, policy in LISTS.items():
        overall = table["policies"][policy]["overall"]
        for m in ("recall@10", "ndcg@10"):
            keys[f"{name}.{a.protocol}.{key}.excl.{m}"] = overall[m]
    sasrec = keys[f"{name}.{a.protocol}.sasrec.excl.recall@10"]
    keys[f"{name}.{a.protocol}.fused.excl.recall_ratio_vs_sasrec"] = (
        keys[f"{name}.{a.protocol}.fused.excl.recall@10"] / sasrec if sasrec else None)
    users = table["n"]
    md = [f"# {name}: a bundle rebuilt from the shipped data with {recipe}", "",
          f"`{command_line('bench.quick_recipe', argv)}`", "", f"{run_line()}; {machine_line()}.", "",
          "| stage | minutes | device |", "|---|---|---|"]
    md += [f"| {s} | {r['minutes']:.1f} | {r.get('device', 'cpu')} |" for s, r in build["stages"].items()]
    md += [f"| all | {build['minutes']:.1f} | |", "",
           f"All {users} test users, history excluded, K = 10 (`specrec eval --policies beam,fused,drafter "
           "--exclude-history`):", "", "| list | R@10 | N@10 |", "|---|---|---|"]
    md += [f"| {key} | {fmt(keys[f'{name}.{a.protocol}.{key}.excl.recall@10'], '.4f')} | "
           f"{fmt(keys[f'{name}.{a.protocol}.{key}.excl.ndcg@10'], '.4f')} |" for key in LISTS]
    md += ["", f"fused / SASRec R@10: {fmt(keys[f'{name}.{a.protocol}.fused.excl.recall_ratio_vs_sasrec'], '.3f')}"]
    publish(Path(a.results), f"quick_recipe_{recipe.stem}", {"build": build, "eval": table, "keys": keys,
                                                            "wall_minutes": wall}, "\n".join(md) + "\n", keys)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
