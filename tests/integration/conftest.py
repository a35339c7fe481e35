"""Shared fixtures of the integration tests: a real Redis, unique namespaces,
and a tiny synthetic bundle.

Redis, in this order:

1. ``$SPECREC_TEST_REDIS_URL`` when set;
2. a server answering PING on 127.0.0.1:6379;
3. a private ``redis-server --port <free> --save "" --appendonly no`` in a temp
   dir, stopped at the end (no ``redis-server`` binary: the tests fail, saying so).

Every test session uses its own namespace prefix (``test-<hex>``); keys under
it are deleted after each test and again at the end of the session, so a
shared server keeps nothing of ours.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from specrec_rpc.server import configure_logging
from specrec_stack.localstack import delete_keys, free_port, namespace_pattern, redis_ping

# the services in this process log as a deployed one would (plain tracebacks, not rich's), in text
configure_logging("INFO", json_logs=False)

SESSION_PREFIX = f"test-{uuid.uuid4().hex[:10]}"
_counter = itertools.count(1)


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real Redis server for the whole test session."""
    url = os.environ.get("SPECREC_TEST_REDIS_URL")
    proc = tmp = None
    if url:
        if not redis_ping(url, 2.0):
            pytest.fail(f"SPECREC_TEST_REDIS_URL={url} does not answer PING")
    elif redis_ping("redis://127.0.0.1:6379/0"):
        url = "redis://127.0.0.1:6379/0"
    else:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("integration tests need Redis: set SPECREC_TEST_REDIS_URL, run a server on 127.0.0.1:6379, "
                        "or install redis-server (apt-get install redis-server) so the tests can start one")
        import tempfile

        tmp = tempfile.mkdtemp(prefix="specrec-redis-")
        port = free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 15
        while not redis_ping(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"could not start {binary} on port {port}")
            time.sleep(0.05)
    try:
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            delete_keys(url, "{" + SESSION_PREFIX + "*")


@pytest.fixture
def namespace(redis_url):
    """A namespace no other test (or test session) uses; its keys are deleted afterwards."""
    ns = f"{SESSION_PREFIX}-{next(_counter)}"
    yield ns
    delete_keys(redis_url, namespace_pattern(ns))


@pytest.fixture(scope="session")
def tiny_bundle_dir(tmp_path_factory) -> Path:
    """A tiny bundle built in seconds: 200 synthetic items (temporal split, so
    some are unseen), real MiniLM text embeddings, RQ 16x16x16 + 64 collision
    digits, an untrained 1+1-layer Tiger."""
    import torch

    from specrec.bundle import Bundle, round_to_half
    from specrec.data import synthetic_dataset, temporal
    from specrec.ids.embed import TextEmbedder
    from specrec.models.tiger import Tiger, TigerConfig
    from specrec.pipeline import fit_semantic_ids

    ds = synthetic_dataset(n_items=200, n_users=300, seed=0)
    cfg = TigerConfig(level_sizes=[16, 16, 16, 64], d_model=32, n_heads=2, d_kv=16, d_ff=64,
                      n_enc_layers=1, n_dec_layers=1, max_history=8)
    split = temporal(ds, cfg.max_history)
    sem, sids, report = fit_semantic_ids(ds, split, TextEmbedder(progress=False), seed=0, n_levels=3,
                                         codebook_size=16, collision_size=64)
    torch.manual_seed(0)
    model = round_to_half(Tiger(cfg))
    bundle = Bundle(ds.name, ds.catalogue, sem, sids, split.seen.copy(), model,
                    {"dataset": ds.name, "protocol": "temporal", "cutoff": split.cutoff, "sid_report": report})
    return bundle.save(tmp_path_factory.mktemp("tiny-bundle") / "bundle")


@pytest.fixture(scope="session")
def tiny_bundle(tiny_bundle_dir):
    """The tiny bundle, loaded (:class:`specrec.bundle.Bundle`)."""
    from specrec.bundle import Bundle

    return Bundle.load(tiny_bundle_dir)


@pytest.fixture(scope="session")
def serving_bundle_dir(tiny_bundle_dir, tmp_path_factory) -> Path:
    """The tiny bundle with every drafter (text, retrieval, self-draft, NEZHA head), for the whole stack;
    services only read it, so one serves every test."""
    from .stack import build_serving_bundle

    return build_serving_bundle(tiny_bundle_dir, tmp_path_factory.mktemp("serving") / "bundle")


@pytest.fixture(scope="session")
def model_only_bundle_dir(tiny_bundle_dir, tmp_path_factory) -> Path:
    """The tiny bundle with its item drafters only: no distilled SID drafter, no NEZHA head."""
    from .stack import build_serving_bundle

    return build_serving_bundle(tiny_bundle_dir, tmp_path_factory.mktemp("model-only") / "bundle",
                                sid_drafters=False)


@pytest.fixture(scope="session")
def fused_bundle_dir(serving_bundle_dir, tmp_path_factory) -> Path:
    """The serving bundle with a SASRec (untrained) and a fusion: the fused policy ranks by both models, the drafter
    service drafts with SASRec by default and auto tries fused first."""
    import torch

    from specrec.bundle import Bundle, round_to_half
    from specrec.models.sasrec import SASRec, SASRecConfig

    b = Bundle.load(serving_bundle_dir)
    torch.manual_seed(2)
    b.sasrec = round_to_half(SASRec(SASRecConfig(n_items=len(b.catalogue), d_model=16, n_layers=1, n_heads=2, d_ff=32,
                                                 max_history=b.cfg.max_history)).eval())
    b.meta["fusion"] = {"weight": 0.4, "norm": "z", "drafts": 20}
    b.meta.setdefault("drafters", {})["unseen_share"] = 0.2
    return b.save(tmp_path_factory.mktemp("fused") / "bundle")


@pytest.fixture(scope="session")
def combiner_bundle_dir(fused_bundle_dir, tmp_path_factory) -> Path:
    """The fused bundle with a learned combiner (seeded random weights) beside its weight: ``fused`` ranks by the
    combiner."""
    import numpy as np

    from specrec.bundle import Bundle
    from specrec.fusion import Combiner

    b = Bundle.load(fused_bundle_dir)
    rng = np.random.default_rng(4)
    F = b.cfg.sid_len + 7
    comb = Combiner(rng.normal(size=(F, 8)), rng.normal(size=8), rng.normal(size=8), 0.0)
    b.meta["fusion"] = {**b.meta["fusion"], "combiner": comb.as_dict()}
    return b.save(tmp_path_factory.mktemp("combiner") / "bundle")


@pytest.fixture(scope="session")
def serving_bundle(serving_bundle_dir):
    from specrec.bundle import Bundle

    return Bundle.load(serving_bundle_dir)
