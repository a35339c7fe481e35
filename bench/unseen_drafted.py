"""Where unseen targets are lost on the temporal split (quality only, no timing): for the random test users
of a sample whose target is unseen, how often the engine's drafter (the text-aware retrieval drafter, with
the bundle's ``drafters.unseen_share``) drafts the target, and how often ``specgr``'s top K holds it with
the unseen places (``specgr.unseen_share``, by default the drafter's) and without them (0).

    python -m bench.unseen_drafted --bundle bundles/beauty-temporal --sample 2000 --seed 0
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from bench.harness import command_line
from specrec.bundle import Bundle, bundle_split
from specrec.data.splits import sample_examples
from specrec.drafters.base import DraftRequest
from specrec.policies import RecRequest, make_policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-temporal")
    ap.add_argument("--sample", type=int, default=2000, help="random test users (the eval's sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--drafts", type=int, default=100, help="drafts asked of the drafter (specgr's delta, 2K)")
    ap.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                    help="draft in every round (specgr.adaptive=false): no online estimate skips a round")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    bundle = Bundle.load(a.bundle)
    _, split = bundle_split(bundle)
    ex = sample_examples(split.test, a.sample, a.seed)
    eng = bundle.engine(drafter="retrieval")
    users = np.nonzero(np.asarray(eng.itemset.is_unseen(np.asarray(ex.target))))[0]
    with_places = make_policy("specgr", eng, adaptive=a.adaptive)
    without = make_policy("specgr", eng, unseen_share=0.0, adaptive=a.adaptive)
    hist = ex.histories()
    drafted = listed = listed_without = 0
    for i in users:
        h, t = np.asarray(hist[i], dtype=np.int64), int(ex.target[i])
        drafted += t in eng.drafter.draft([DraftRequest(history=h, n=a.drafts)])[0].items.tolist()
        listed += t in with_places.run([RecRequest(h, a.k)])[0].items.tolist()
        listed_without += t in without.run([RecRequest(h, a.k)])[0].items.tolist()
    out = {"command": command_line("bench.unseen_drafted", argv), "bundle": a.bundle, "sample": a.sample,
           "seed": a.seed, "k": a.k, "drafts": a.drafts,
           "drafter_unseen_share": eng.drafter.unseen_share, "unseen_target_users": int(len(users)),
           "target_drafted": drafted, "target_listed_with_places": listed,
           "target_listed_without_places": listed_without}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
