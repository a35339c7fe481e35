"""A tiny in-process engine for policy tests: random GR model, random
catalogue, a real VectorDrafter over random item vectors, a NEZHA head."""

from __future__ import annotations

import numpy as np
import torch

from specrec.backends import Backend, make_backend
from specrec.drafters.vector import VectorDrafter
from specrec.itemset import LocalItemSet
from specrec.models.nezha_head import NezhaHead
from specrec.models.sid_mlp import SidMlpConfig, SidMlpDrafter
from specrec.models.tiger import Tiger
from specrec.policies import Engine
from specrec.verifier import LocalVerifier

from ..conftest import random_sids, sharpen, tiny_config


class HashDrafter(VectorDrafter):
    """Deterministic user vectors from the history (a stand-in user model)."""

    name = "hash"

    def __init__(self, vectors, itemset, noise_seed=0):
        super().__init__(vectors, itemset)
        self.calls = []
        self.seed = noise_seed

    def user_vectors(self, histories):
        out = []
        for h in histories:
            v = self.vectors[np.asarray(h)[-3:]].mean(0)
            rng = np.random.default_rng(abs(hash(tuple(np.asarray(h).tolist()))) % (2**32) + self.seed)
            out.append(v + 0.3 * rng.normal(size=v.shape))
        return np.asarray(out, dtype=np.float32)

    def draft(self, requests):
        self.calls.append(list(requests))
        return super().draft(requests)


def make_engine(seed=0, n_items=60, unseen_frac=0.0, sharp=30.0, level_sizes=(6, 5, 4, 3), with_head=True,
                distilled=False, backend=None):
    """``distilled``: give the backend a (random) distilled drafter, so ``strict``/``nezha`` use it;
    ``backend``: a backend name (default: the eager reference)."""
    torch.manual_seed(seed)
    cfg = tiny_config(level_sizes=list(level_sizes))
    model = Tiger(cfg).eval()
    sharpen(model, sharp)
    sids = random_sids(n_items, cfg.level_sizes, seed)
    rng = np.random.default_rng(seed)
    seen = rng.random(n_items) >= unseen_frac
    itemset = LocalItemSet(sids, seen, cfg.level_sizes)
    vectors = rng.normal(size=(n_items, 16)).astype(np.float32)
    head = NezhaHead(model).eval() if with_head else None
    drafter = SidMlpDrafter(cfg.level_sizes, cfg.d_model, SidMlpConfig(hidden=16, ff=32)).eval() if distilled else None
    be = Backend(model, head, drafter=drafter) if backend in (None, "eager") else make_backend(backend, model, head,
                                                                                                   drafter=drafter)
    verifier = LocalVerifier(be, head, model)
    return Engine(verifier, itemset, cfg.max_history, HashDrafter(vectors, itemset, seed))


def histories(engine, n, seed=0):
    rng = np.random.default_rng(seed)
    N = engine.itemset.n_rows
    return [rng.integers(0, N, int(rng.integers(1, engine.max_history + 3))) for _ in range(n)]


def slow_calls(eng, t, seconds: dict[str, float]) -> None:
    """Each named verifier method (``draft``: the drafter's) advances the fake clock ``t`` (a one-element
    list, with ``eng.clock = lambda: t[0]``) by its time, then runs: costs are then learned by running."""
    for name, dt in seconds.items():
        owner = eng.drafter if name == "draft" else eng.verifier
        fn = getattr(owner, name)

        def slow(*a, _fn=fn, _dt=dt, **kw):
            t[0] += _dt
            return _fn(*a, **kw)

        setattr(owner, name, slow)


class RulesServing:
    """:class:`specrec.policies.engine.Serving` with the gateway's rules (:class:`gateway.budget.Budget`) and
    settable parts: ``load`` (the queue's wait per policy), ``reserve`` (out of the time left, for a verifier
    policy's fallback), ``reserve_held`` (a policy whose fallback is in hand), ``cut_margin`` (how early the cut
    fires) and ``is_down``."""

    def __init__(self) -> None:
        self.load = lambda policy: 0.0
        self.reserve = lambda left: 0.0
        self.reserve_held = 0.0
        self.cut_margin = lambda left: 0.0
        self.is_down = lambda dependency: False

    def wait(self, policy: str) -> float:
        return self.load(policy)

    def kept_back(self, policy: str, left: float) -> float:
        from specrec.costs import Resource, resource_of
        from specrec.policies import POLICIES

        if resource_of(policy) is Resource.DRAFTER:
            kept = 0.0
        else:
            kept = self.reserve_held if POLICIES[policy].holds_fallback else self.reserve(left)
        return kept + self.cut_margin(left)

    def down(self, dependency: str) -> bool:
        return self.is_down(dependency)


def rules(eng: Engine) -> RulesServing:
    """The engine's :class:`RulesServing` (installed the first time)."""
    if not isinstance(eng.serving, RulesServing):
        eng.serving = RulesServing()
    return eng.serving
