"""``specgr``: draft, verify in one pass, accept, exit early; re-draft guided
by the GR's own beam prefixes (SpecGR, AAAI'26), per request.

Per round and request:

1. the drafter proposes ``delta`` items (never one already verified for this
   request; after round 0 only items under *this request's* beam prefixes);
2. the verifier scores them in one teacher-forced pass; the score V is the
   length-normalised log-likelihood, over L-1 levels for items the
   catalogue flags unseen (the L-1 rule);
3. items with V > gamma (strictly) are accepted; a request with K accepted
   exits (``accepted``);
4. otherwise the request's beam search advances one level and its prefixes
   guide the next round.

When the beams are complete (``beams_complete``), or the budget cannot fit
another round (``budget``), the list is filled up to K from rejected
candidates and complete beams on the same V scale, and sorted by V. With
delta = 0 this is beam search (items ordered by V).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from pydantic import Field

from ..drafters.base import DraftRequest
from .base import (
    Candidates, Policy, PolicyConfig, RecRequest, RecResult, RequestStats, Stage, charge, length_normalised, register,
)


class SpecGRConfig(PolicyConfig):
    delta: int = Field(50, ge=0, description="items drafted per request per round")
    beta: int | None = Field(None, ge=1, description="beam width of guided re-drafting (default: K)")
    gamma: float = Field(-1.0, description="accept a draft when its length-normalised log-likelihood V > gamma")
    unseen_rule: bool = Field(True, description="score unseen items over the first L-1 levels")
    max_rounds: int | None = Field(None, ge=1, description="draft rounds at most (default: L, one per beam level)")


@register
class SpecGRPolicy(Policy):
    name = "specgr"
    Config = SpecGRConfig

    def _verify(self, sess, drafts, active, stats, unseen_fn):
        """Score the drafts of the active requests in one pass -> list of V arrays."""
        eng = self.engine
        m = max(len(d.items) for d in drafts)
        L = len(eng.itemset.level_sizes)
        sids = np.zeros((len(active), m, L), dtype=np.int64)
        for j, d in enumerate(drafts):
            if len(d.items):
                sids[j, : len(d.items)] = eng.itemset.sids_of(d.items)
                sids[j, len(d.items) :] = sids[j, 0]
        scores = eng.verifier.score(sess, torch.from_numpy(sids))
        charge([stats[i] for i in active])
        out = []
        for j, d in enumerate(drafts):
            tl = scores.token_logp[j, : len(d.items)]
            v = length_normalised(tl, unseen_fn(d.items)) if self.config.unseen_rule else tl.mean(-1)
            out.append(v.numpy())
        return out

    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        eng, ver, cfg = self.engine, self.engine.verifier, self.config
        if cfg.delta and eng.drafter is None:
            raise ValueError("specgr needs a drafter (delta > 0)")
        trie = eng.itemset.trie
        L = len(eng.itemset.level_sizes)
        n = len(requests)
        beta = cfg.beta or max(r.k for r in requests)
        max_rounds = cfg.max_rounds or L
        stats = [RequestStats() for _ in requests]
        pool = [Candidates() for _ in requests]  # every verified candidate (accepted or not), by V
        accepted = [0] * n
        verified: list[set[int]] = [set() for _ in requests]
        results: list[RecResult | None] = [None] * n
        unseen_fn = eng.itemset.is_unseen

        with Stage(eng.clock, stats, "encode"):
            sess = ver.encode(eng.history_sids([r.history for r in requests]))
        charge(stats, encoder=True)
        ver.beam_start(sess, trie, beta)
        active = list(range(n))
        beams = None  # beams of the active requests, rows aligned with `active`

        def finish(rows: list[int], reason: str, complete: bool) -> None:
            for j in rows:
                i = active[j]
                stats[i].exit_reason = reason
                if complete and beams is not None:
                    ok = beams.alive()[j]
                    items = beams.items(trie)[j][ok].numpy()
                    v = length_normalised(beams.token_logp[j][ok], unseen_fn(items)) if cfg.unseen_rule else beams.token_logp[j][ok].mean(-1)
                    pool[i].add(items, v.numpy(), "beam")
                items, scores, sources = pool[i].top(requests[i].k)
                prefixes = None if complete else beams
                results[i] = self._result(requests[i].k, items, scores, sources, stats[i], prefixes, j)

        def drop(rows: list[int]) -> None:
            nonlocal sess, beams, active
            keep = [j for j in range(len(active)) if j not in set(rows)]
            if rows and keep:
                idx = torch.tensor(keep)
                sess = ver.select(sess, idx)
                beams = beams.select(idx) if beams is not None else None
            active = [active[j] for j in keep]

        for rnd in range(max_rounds):
            late = [j for j, i in enumerate(active) if not self.budget.fits(requests[i].deadline, "round")]
            finish(late, "budget", complete=False)
            drop(late)
            if not active:
                break
            t_round = eng.clock()
            act_stats = [stats[i] for i in active]
            for st in act_stats:
                st.rounds += 1
            if cfg.delta:
                dreqs = []
                for j, i in enumerate(active):
                    prefixes = None
                    if beams is not None:
                        ok = beams.alive()[j]
                        prefixes = beams.codes[j][ok].numpy()
                    dreqs.append(DraftRequest(requests[i].history, cfg.delta, prefixes, frozenset(verified[i])))
                with Stage(eng.clock, act_stats, "draft"):
                    drafts = eng.drafter.draft(dreqs)
                if any(len(d.items) for d in drafts):
                    with Stage(eng.clock, act_stats, "verify"):
                        values = self._verify(sess, drafts, active, stats, unseen_fn)
                    for j, i in enumerate(active):
                        d, v = drafts[j], values[j]
                        acc = v > cfg.gamma
                        pool[i].add(d.items, v, "draft")
                        verified[i].update(d.items.tolist())
                        accepted[i] += int(acc.sum())
                        st = stats[i]
                        st.drafted += len(d.items)
                        st.accepted += int(acc.sum())
                        st.accepted_by_round.append(int(acc.sum()))
                    # K accepted: every accepted V > gamma >= every rejected V, so the top K are accepted ones
                    done = [j for j, i in enumerate(active) if accepted[i] >= requests[i].k]
                    finish(done, "accepted", complete=False)
                    drop(done)
                    if not active:
                        break
            if beams is not None and beams.level >= L:
                break
            act_stats = [stats[i] for i in active]
            with Stage(eng.clock, act_stats, "beam"):
                beams = ver.beam_step(sess)
            charge(act_stats)
            self.budget.observe("round", eng.clock() - t_round)
        if active:
            # beams complete (or rounds exhausted): finish the beams if they are not, then fill
            complete = beams is not None and beams.level >= L
            finish(list(range(len(active))), "beams_complete" if complete else "max_rounds", complete=complete)
        ver.release(sess)
        return self._finish(results)
