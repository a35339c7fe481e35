"""Level-by-level verification of drafted SIDs (shared by ``strict`` and ``relaxed``).

Drafts (N SIDs per request, from the NEZHA head or a drafter) are scored by
the verifier in ONE teacher-forced pass that returns the target's full
next-level distribution after every draft prefix. Beam search then runs
level by level on the target's own distributions: a beam whose prefix is a
draft prefix reads its distribution from that pass; beams off the drafts
(misses) get theirs from one batched verifier call for the level, and only
those beams are computed. With good drafts a whole search costs the encoder
plus two decoder passes instead of L steps.

How the next beams are chosen is the policy's: ``strict`` takes the exact
top-K (so its output equals ``beam``); ``relaxed`` prefers drafted tokens the
target finds good enough.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from pydantic import Field

from ..decoding.beam import Beams, root_beams
from ..drafters.base import DraftRequest
from ..ids.trie import SidTrie
from .base import Policy, PolicyConfig, RecRequest, RecResult, RequestStats, Stage, charge

class LevelwiseConfig(PolicyConfig):
    width: int | None = Field(None, ge=1, description="beam width (default: K)")
    n_drafts: int = Field(50, ge=1, description="drafted SIDs per request")
    drafter: Literal["head", "drafter"] = Field("head", description="draft with the NEZHA head or the engine's drafter")


class LevelwisePolicy(Policy):
    Config = LevelwiseConfig

    def select(self, beams: Beams, logp: torch.Tensor, trie: SidTrie, width: int, drafted: list[dict]) -> Beams:
        """Next beams from the current ones and the target's next-level
        log-probs ``logp`` [R, B, V]; ``drafted[i][prefix]`` is the set of
        codes the drafts put after ``prefix`` for request i."""
        raise NotImplementedError

    def _drafts(self, sess, requests, stats) -> torch.Tensor:
        """Draft SIDs [R, N, L] and a validity mask [R, N]."""
        eng, cfg = self.engine, self.config
        if cfg.drafter == "head":
            with Stage(eng.clock, stats, "draft"):
                b = eng.verifier.head_beams(sess, eng.itemset.trie, cfg.n_drafts)
            charge(stats)
            return b.codes, b.alive()
        if eng.drafter is None:
            raise ValueError(f"{self.name} with drafter='drafter' needs an engine drafter")
        with Stage(eng.clock, stats, "draft"):
            drafts = eng.drafter.draft([DraftRequest(r.history, cfg.n_drafts) for r in requests])
        L = len(eng.itemset.level_sizes)
        m = max(1, max(len(d.items) for d in drafts))
        codes = torch.zeros(len(requests), m, L, dtype=torch.int64)
        ok = torch.zeros(len(requests), m, dtype=torch.bool)
        for i, d in enumerate(drafts):
            if len(d.items):
                codes[i, : len(d.items)] = torch.from_numpy(eng.itemset.sids_of(d.items))
                ok[i, : len(d.items)] = True
        return codes, ok

    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        eng, ver = self.engine, self.engine.verifier
        trie = eng.itemset.trie
        L = len(eng.itemset.level_sizes)
        R = len(requests)
        width = self.config.width or max(r.k for r in requests)
        stats = [RequestStats() for _ in requests]
        with Stage(eng.clock, stats, "encode"):
            sess = ver.encode(eng.history_sids([r.history for r in requests]))
        charge(stats, encoder=True)
        codes, ok = self._drafts(sess, requests, stats)
        with Stage(eng.clock, stats, "verify"):
            full = ver.score(sess, codes, full=True).full  # per level j: [R, N, V_j] after draft[:j]
        charge(stats)
        # draft prefix (any length < L) -> draft row holding its next-level distribution
        table: list[dict] = []
        drafted: list[dict] = []  # level -> {prefix: set of drafted next codes}
        for i in range(R):
            t, dr = {}, {}
            for n in torch.nonzero(ok[i]).squeeze(1).tolist():
                sid = tuple(codes[i, n].tolist())
                for j in range(L):
                    t.setdefault(sid[:j], n)
                    dr.setdefault(sid[:j], set()).add(sid[j])
            table.append(t)
            drafted.append(dr)
            stats[i].drafted = int(ok[i].sum())
            stats[i].drafted_by_position = [0] * L
            stats[i].accepted_by_position = [0] * L

        beams = root_beams(R)
        for level in range(L):
            bc = beams.codes.shape[1]
            logp = torch.zeros(R, bc, eng.itemset.level_sizes[level])
            alive = beams.alive()
            miss: list[list[int]] = [[] for _ in range(R)]
            for i in range(R):
                for b in torch.nonzero(alive[i]).squeeze(1).tolist():
                    n = table[i].get(tuple(beams.codes[i, b].tolist()))
                    stats[i].draft_tokens += 1
                    stats[i].drafted_by_position[level] += 1
                    if n is None:
                        miss[i].append(b)
                    else:
                        logp[i, b] = full[level][i, n]
                        stats[i].accepted_tokens += 1
                        stats[i].accepted_by_position[level] += 1
            if any(miss):
                rows = [i for i in range(R) if miss[i]]
                m = max(len(miss[i]) for i in rows)
                pre = torch.zeros(R, m, level, dtype=torch.int64)
                for i in rows:
                    pre[i, : len(miss[i])] = beams.codes[i, miss[i]]
                    pre[i, len(miss[i]) :] = beams.codes[i, miss[i][0]]
                with Stage(eng.clock, [stats[i] for i in rows], "fallback"):
                    got = ver.next_logprobs(sess, pre)
                charge([stats[i] for i in rows])
                for i in rows:
                    logp[i, miss[i]] = got[i, : len(miss[i])]
            beams = self.select(beams, logp, trie, width, drafted)
            for st in stats:
                st.rounds += 1
        items = beams.items(trie)
        results = []
        for i, r in enumerate(requests):
            a = beams.alive()[i]
            its = items[i][a]
            draft_sids = {tuple(x) for x in codes[i][ok[i]].tolist()}
            stats[i].accepted = sum(tuple(x) in draft_sids for x in beams.codes[i][a].tolist())
            stats[i].exit_reason = "complete"
            results.append(self._result(r.k, its.tolist(), beams.scores[i][a].tolist(), self._sources(beams, i, a, drafted[i]), stats[i]))
        ver.release(sess)
        return self._finish(results)

    @staticmethod
    def _sources(beams: Beams, i: int, alive: torch.Tensor, drafted: dict) -> list[str]:
        out = []
        for sid in beams.codes[i][alive].tolist():
            on = all(sid[j] in drafted.get(tuple(sid[:j]), ()) for j in range(len(sid)))
            out.append("draft" if on else "beam")
        return out
