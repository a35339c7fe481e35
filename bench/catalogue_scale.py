"""What a request costs as the catalogue grows: the committed model on synthetic catalogues of 12k to 10M items.

    nice -n 19 python -m bench.catalogue_scale --bundle bundles/beauty-loo --sizes 12k,100k,1m,10m

Each catalogue is the bundle's real items first (so the sampled test histories stay valid, and the 12k one *is*
the bundle's catalogue), then distinct random SIDs (seeded, none equal to a real item's) up to the size, as unseen
items (no training interactions, no text). Per size, in this process:

- **tables**: the item set's trie and the whole searches' tables (:meth:`~specrec.ids.trie.SidTrie.search_tables`:
  per level a dense child table or CSR arrays, :mod:`specrec.ids.tables`) built, timed (``build_s``), and their
  memory: ``tables_mb`` (what the searches read, and what a GPU holds), ``trie_mb`` (the trie's own arrays, which
  the step-by-step searches and lookups read: a CSR level's arrays are the trie's, counted in both; below
  :data:`~specrec.ids.trie.DENSE_LIMIT` cells a level also keeps a bool mask for the step-by-step searches), and
  each level's form (``forms``: ``d`` dense, ``c`` CSR);
- **policies**: ``beam``, ``nezha`` and ``fused`` on an engine over that catalogue (the bundle's default backend,
  ONNX Runtime, one thread, and its SASRec drafter), each request K = 10 for the same ``--users`` seeded random
  leave-one-out test histories, ``--rounds`` times, every size's engine built first and the sizes and policies
  interleaved per request after a warm-up (graphs exported and loaded), so that drift of the machine moves every
  size alike: p50 and p99 ms (``exclude_history``: the default off, as the gateway's, or on with
  ``--exclude-history``). The synthetic items have neither SASRec vectors nor text, so ``fused``'s candidates
  are the real items SASRec knows; what grows for it is the item set.

Keys (``catalogue.<size>.``): ``tables_mb``, ``trie_mb``, ``build_s``, ``<policy>.p50_ms``, ``<policy>.p99_ms``.
Writes ``catalogue_scale.{json,md,png}`` (the plot: each policy's p50 and p99 against the catalogue's size, and the
tables' memory and build time) through :func:`bench.harness.publish`.

With ``--parts itemset`` (:func:`itemset_part`), per size, the item set in a private ``redis-server``: bulk load,
Redis memory per item, upsert p50/p99, the item set's mirror, a follower's packed snapshot and a version change's
delta (keys ``catalogue.<size>.itemset.*``). With ``--parts stack`` (:func:`stack_part`), the four services on the
catalogue: each one's start (``catalogue.<size>.start_s.<service>``) and ``auto`` at 30 ms in a closed loop
(``catalogue.<size>.gateway.auto.gr_ranked_share_at_30ms``); the drafter loads the modes ``--stack-drafter-modes``
says (:func:`drafter_modes`: past 100k items only the bundle's default, which ``auto`` drafts with). Run the big
sizes on a machine of their own: 10M items take a few GB and minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import textwrap
import time
from pathlib import Path

import numpy as np

from bench.harness import RESULTS_DIR, command_line, machine_line, pct, publish, run_line, sample_users, sayer

say = sayer("catalogue_scale", clock=True)
POLICIES = ("beam", "nezha", "fused")
PARTS = ("inprocess", "itemset", "stack")
ITEMSET_KEYS = ("load_s", "redis_mb", "bytes_per_item", "upsert_p50_ms", "upsert_p99_ms", "mirror_load_s", "mirror_mb",
                "pack_s", "follower_load_s", "follower_mb", "delta_apply_ms")


def parse_size(s: str) -> int:
    """``12k``, ``100k``, ``1m``, ``10m``, ``250000`` -> items."""
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def synthetic_sids(real: np.ndarray, level_sizes: list[int], n: int, seed: int) -> np.ndarray:
    """``real`` [R, L] then ``n - R`` distinct random SIDs none of which is a real item's -> [max(n, R), L]."""
    from specrec.ids.trie import mixed_radix

    need = n - len(real)
    if need <= 0:
        return real
    space = float(np.prod(np.asarray(level_sizes, dtype=np.float64)))
    if space < n or space >= 2.0**62:
        raise SystemExit(f"a code space of {space:.3g} SIDs cannot hold {n} distinct items as one int64 key each")
    rng = np.random.default_rng(seed)
    taken = np.unique(mixed_radix(real, level_sizes))
    keys = np.zeros(0, dtype=np.int64)
    while len(keys) < need:  # draw with replacement, keep the new distinct ones
        draw = rng.integers(0, int(space), int((need - len(keys)) * 1.05) + 16, dtype=np.int64)
        keys = np.unique(np.concatenate([keys, draw[~np.isin(draw, taken)]]))
    keys = rng.permutation(keys)[:need]
    out = np.zeros((need, len(level_sizes)), dtype=np.int64)
    for lvl in range(len(level_sizes) - 1, -1, -1):
        out[:, lvl] = keys % level_sizes[lvl]
        keys //= level_sizes[lvl]
    return np.concatenate([real, out])


def label_of(n: int, real: int) -> str:
    """The key's name of a size: ``12k`` (the bundle's own catalogue), ``100k``, ``1m``, ``10m``."""
    if n <= real:
        return f"{round(real / 1000)}k"
    return f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{round(n / 1000)}k"


def build_tables(sids: np.ndarray, seen: np.ndarray, level_sizes: list[int], vmax: int):
    """The item set over ``sids`` with its trie and search tables built -> (item set, figures)."""
    from specrec.ids.tables import form_tag
    from specrec.itemset import LocalItemSet

    t0 = time.perf_counter()
    itemset = LocalItemSet(sids, seen, level_sizes, version="1")
    trie = itemset.trie
    levels = trie.search_tables(vmax)
    build_s = time.perf_counter() - t0

    def mb(ts) -> float:
        return sum(t.numel() * t.element_size() for t in ts if t is not None) / 2**20

    trie_arrays = [*trie.keys, *trie.ptr, *trie.codes, trie.leaf_item, *trie.dense]
    full = 0.0 if trie.full_keys is None else trie.full_keys.nbytes / 2**20
    return itemset, {"items": len(sids), "build_s": build_s, "tables_mb": sum(lv.nbytes for lv in levels) / 2**20,
                     "trie_mb": mb(trie_arrays) + full, "forms": form_tag(levels),
                     "nodes": [len(p) - 1 for p in trie.ptr], "edges": [len(c) for c in trie.codes]}


def engine_over(bundle, backend, itemset):
    """An in-process engine over ``itemset``: the local verifier on ``backend`` and the bundle's SASRec drafter
    (with its fusion; no unseen share: the synthetic items have no text to draft them by)."""
    from specrec.drafters.sasrec import SasrecDrafter
    from specrec.policies.engine import Engine
    from specrec.verifier import LocalVerifier

    drafter = None
    if bundle.sasrec is not None:
        drafter = SasrecDrafter(bundle.sasrec, itemset, None, 0.0, bundle.fusion)
    return Engine(LocalVerifier(backend, bundle.nezha_head, bundle.model), itemset, bundle.cfg.max_history, drafter)


def time_policies(engines: dict, rows: list[np.ndarray], policies, k: int, rounds: int, exclude: bool) -> dict:
    """Each policy on every history ``rounds`` times over each catalogue's engine (``engines``: label -> engine),
    after one warm round, interleaved per request: a history's requests go to every catalogue and policy in turn,
    so that a machine whose speed drifts during the run moves every size's figures alike (measured one size after
    another, the same step put 10M at 0.71-0.75x and 1.43-1.46x of 12k in two runs an hour apart) -> label ->
    policy -> {p50_ms, p99_ms, n, lists of the first round}."""
    from specrec.policies import RecRequest, make_policy

    pols = {label: {p: make_policy(p, eng) for p in policies} for label, eng in engines.items()}
    ms: dict = {label: {p: [] for p in policies} for label in engines}
    lists: dict = {label: {p: [] for p in policies} for label in engines}
    for rnd in range(rounds + 1):
        for h in rows:
            for label, by_policy in pols.items():
                for p, pol in by_policy.items():
                    req = RecRequest(np.asarray(h, dtype=np.int64), k, exclude_history=exclude)
                    t0 = time.perf_counter()
                    res = pol.run([req])[0]
                    dt = (time.perf_counter() - t0) * 1e3
                    if rnd == 0:
                        lists[label][p].append([int(x) for x in res.items[:k]])
                    else:
                        ms[label][p].append(dt)
        say(f"round {rnd} of {rounds} timed" if rnd else "warm round done")
    return {label: {p: {"p50_ms": pct(ms[label][p], 50), "p99_ms": pct(ms[label][p], 99), "n": len(ms[label][p]),
                        "lists": lists[label][p]} for p in policies} for label in engines}


def itemset_part(label: str, sids: np.ndarray, seen: np.ndarray, ids: list[str], level_sizes: list[int], a) -> dict:
    """The item set of this catalogue in a private ``redis-server`` (never the machine's own): the bulk load
    (``load_s``), Redis's memory (``redis_mb``, ``bytes_per_item``, each data key's ``MEMORY USAGE``), ``--upserts``
    one-item upserts with explicit SIDs, half new items and half replacements, each a published version
    (``upsert_p50_ms``, ``upsert_p99_ms``), and the mirrors: the item set's own read from Redis
    (``mirror_load_s``, ``mirror_mb``: from the data's packed copy, the items changed since on top), a follower's
    from a packed snapshot (``pack_s`` on the item set's side,
    ``follower_load_s`` and ``follower_mb`` on the follower's, its trie included) and a version change's delta
    applied by the follower (``delta_apply_ms``). Memory of the mirrors is this process's resident growth:
    rough."""
    import asyncio
    import os
    import tempfile

    from bench.harness import Redis, rss_mb

    tmp = Path(tempfile.mkdtemp(prefix="specrec-catalogue-itemset-"))
    redis = Redis(None, tmp, private=True)
    try:
        return asyncio.run(_itemset_figures(label, redis.url, sids, seen, ids, level_sizes, a,
                                            lambda: rss_mb(os.getpid()) or float("nan")))
    finally:
        redis.stop()


async def _itemset_figures(label: str, url: str, sids: np.ndarray, seen: np.ndarray, ids: list[str],
                           level_sizes: list[int], a, rss) -> dict:
    import redis.asyncio as aioredis

    from itemset_svc.bulk import CatalogueArrays
    from itemset_svc.mirror import read_mirror
    from itemset_svc.servicer import _packed_chunks, to_pb
    from itemset_svc.store import RedisCatalogue, UpsertSpec
    from specrec.ids.trie import mixed_radix
    from specrec_rpc.catalogue import apply_delta, build_snapshot_columns
    from specrec_rpc.packed import unpack

    out: dict = {"items": len(sids)}
    r = aioredis.from_url(url, decode_responses=True)
    store = RedisCatalogue.from_url(url, "bench", timeout_s=120.0)
    try:
        used0 = int((await r.info("memory"))["used_memory"])
        cat = CatalogueArrays(ids, sids, ~seen)
        t0 = time.perf_counter()
        version = await store.bulk_load(cat, level_sizes)
        out["load_s"] = time.perf_counter() - t0
        used = int((await r.info("memory"))["used_memory"]) - used0
        out["redis_mb"], out["bytes_per_item"] = used / 2**20, used / len(sids)
        lay = await store.layout(version)
        out["key_mb"] = {name: (await r.memory_usage(store.keys.dkey(lay.data, name)) or 0) / 2**20
                         for name in ("sid2item", "items", "pfx")}
        say(f"{label}: bulk load {out['load_s']:.1f} s, Redis {out['redis_mb']:.0f} MB "
            f"({out['bytes_per_item']:.0f} B/item: " + ", ".join(f"{k} {v:.0f} MB" for k, v in out["key_mb"].items())
            + ")")

        # one-item upserts, each a version: half new items, half replacements of synthetic ones, fresh SIDs
        rng = np.random.default_rng(a.seed + 1)
        taken = set(mixed_radix(sids, level_sizes).tolist())
        ms = []
        for j in range(a.upserts):
            item = f"bench-new-{j}" if j % 2 == 0 else ids[-1 - j]
            sid = _free_sid(taken, level_sizes, rng)
            t0 = time.perf_counter()
            await store.upsert([UpsertSpec(item, sid=sid)])
            ms.append((time.perf_counter() - t0) * 1e3)
        out["upsert_p50_ms"], out["upsert_p99_ms"] = pct(ms, 50), pct(ms, 99)
        out["redis_after_upserts_mb"] = (int((await r.info("memory"))["used_memory"]) - used0) / 2**20
        say(f"{label}: {a.upserts} upserts p50 {out['upsert_p50_ms']:.2f} ms, p99 {out['upsert_p99_ms']:.2f} ms; "
            f"Redis {out['redis_after_upserts_mb']:.0f} MB after them")

        # the item set's own mirror, read from Redis (what its start does)
        gc.collect()
        m0 = rss()
        t0 = time.perf_counter()
        info = await store.info()
        mirror = await read_mirror(store, info.version, info.bundle)
        v, ls, fp = mirror.version, mirror.level_sizes, mirror.fingerprint
        out["mirror_load_s"] = time.perf_counter() - t0
        out["mirror_mb"] = rss() - m0
        # a follower's copy: the item set packs the snapshot, the follower unpacks and indexes it
        t0 = time.perf_counter()
        chunks = _packed_chunks(*mirror.columns())
        out["pack_s"] = time.perf_counter() - t0
        out["packed_mb"] = sum(c.ByteSize() for c in chunks) / 2**20
        gc.collect()
        f0 = rss()
        t0 = time.perf_counter()
        cols = unpack([c.packed for c in chunks], len(ls))
        snap = build_snapshot_columns(v, ls, cols, fp)
        out["follower_load_s"] = time.perf_counter() - t0
        del cols, chunks
        gc.collect()
        out["follower_mb"] = rss() - f0
        say(f"{label}: item set's mirror from Redis {out['mirror_load_s']:.1f} s (+{out['mirror_mb']:.0f} MB); "
            f"packed snapshot {out['packed_mb']:.0f} MB in {out['pack_s']:.1f} s; a follower's copy "
            f"{out['follower_load_s']:.1f} s (+{out['follower_mb']:.0f} MB)")

        # a version change as the follower sees it: one more upsert, its delta applied to the follower's copy
        res = await store.upsert([UpsertSpec(ids[-1], sid=_free_sid(taken, level_sizes, rng))])
        mirror.apply(res)
        d = mirror.delta(v)
        assert d is not None
        t0 = time.perf_counter()
        apply_delta(snap, res.version, [to_pb(rec) for rec in d[0]], d[1], mirror.fingerprint)
        out["delta_apply_ms"] = (time.perf_counter() - t0) * 1e3
        say(f"{label}: a version change's delta ({len(d[0])} item) applied by a follower in "
            f"{out['delta_apply_ms']:.0f} ms")
    finally:
        await store.close()
        await r.aclose()
    return out


def _free_sid(taken: set, level_sizes: list[int], rng) -> tuple[int, ...]:
    space = int(np.prod(level_sizes))
    """A random SID no item has (nor one drawn before), as codes."""
    key = int(rng.integers(0, space))
    while key in taken:
        key = int(rng.integers(0, space))
    taken.add(key)
    codes = []
    for n in reversed(level_sizes):
        codes.append(key % n)
        key //= n
    return tuple(reversed(codes))


DRAFTER_ALL_MODES_UP_TO = 100_000


def drafter_modes(asked: str, items: int, default: str) -> str:
    """The drafter's ``modes`` for a stack on ``items`` items: ``asked`` unless "auto"; auto: every mode the bundle
    has (empty) up to :data:`DRAFTER_ALL_MODES_UP_TO` items, else only ``default`` (the bundle's default mode, the
    one ``auto`` drafts with): the retrieval and self drafters hold about 3.6 KB and 0.5 KB per item, and the
    self-drafter searches the rows past the bundle's exactly (the synthetic items have no text: the retrieval
    drafter skips them; docs/catalogue.md)."""
    if asked != "auto":
        return asked
    return "" if items <= DRAFTER_ALL_MODES_UP_TO else default


def stack_part(label: str, sids: np.ndarray, seen: np.ndarray, ids: list[str], bundle_dir: str, a) -> dict:
    """The four services on this catalogue (:class:`bench.harness.Stack`, a private ``redis-server``): the
    catalogue bulk-loaded into the stack's namespace first (the bundle's items with their texts, then the
    synthetic ones, recorded as the bundle's), each service's start until SERVING (``start_s``), then ``auto``
    through the gateway in a closed loop at a 30 ms budget on ``--stack-users`` seeded random test users:
    who served each answer (``served_by``) and the share of lists the GR model made or ranked
    (``gr_ranked_share``). The drafter loads :func:`drafter_modes` (``drafter_modes`` in the result; "" = all)."""
    import asyncio
    import re
    import tempfile

    from bench.harness import Redis, Stack, kernel_stalls, sample_users
    from bench.serving_phases import closed_loop, summarise
    from itemset_svc.bulk import CatalogueArrays
    from itemset_svc.load import bundle_arrays
    from itemset_svc.store import RedisCatalogue
    from specrec.bundle import Bundle, sid_space_fingerprint

    b = Bundle.load(bundle_dir)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-catalogue-stack-"))
    redis = Redis(None, tmp, private=True)
    modes = drafter_modes(a.stack_drafter_modes, len(sids), b.default_drafter() or "")
    stack = Stack(Path(bundle_dir).resolve(), redis, tmp / "logs", f"catalogue-{label}", threads=1,
                  max_history=b.cfg.max_history, env={"SPECREC_DRAFTER_MODES": modes})
    out: dict = {"items": len(sids), "users": a.stack_users, "drafter_modes": modes}
    try:
        real, level_sizes = bundle_arrays(bundle_dir)
        synth = len(sids) - len(real)
        cat = CatalogueArrays(ids, sids, ~seen, titles=[*(real.titles or []), *[""] * synth],
                              texts=[*(real.texts or []), *[""] * synth])

        async def load() -> float:
            store = RedisCatalogue.from_url(stack.redis_url, stack.namespace, timeout_s=120.0)
            try:
                t0 = time.perf_counter()
                await store.bulk_load(cat, level_sizes, bundle=sid_space_fingerprint(bundle_dir))
                return time.perf_counter() - t0
            finally:
                await store.close()

        out["load_s"] = asyncio.run(load())
        starts: dict[str, float] = {}

        def heard(msg: str) -> None:
            say(msg)
            if m := re.match(r"(\w+) SERVING after ([\d.]+) s", msg):
                starts[m.group(1)] = float(m.group(2))

        stack.start(timeout=a.stack_timeout, say=heard)
        out["start_s"] = starts
        users = sample_users(b, a.stack_users, a.seed)
        before = kernel_stalls()
        answers = asyncio.run(closed_loop(stack.addr("gateway"), users, "auto", a.k, 30.0, len(users.ids)))
        after = kernel_stalls()
        closed = summarise(answers, np.zeros(len(users.ids)), len(users.ids), a.k)
        keys = ("answered", "errors", "gr_ranked_share", "served_by", "budget_exit_share", "p50_ms", "p99_ms",
                "max_ms", "server_p50_ms", "server_p99_ms", "overhead_p50_ms")
        out["closed"] = {k: closed[k] for k in keys if k in closed}
        # what the kernel did meanwhile: a request or two answered tens of ms late set auto's share at 10M apart
        # between runs, and nothing in the services explained them
        out["closed"]["kernel"] = {k: after[k] - before[k] for k in after if k in before}
        if a.stack_probe:  # the named policy through the same stack, its budget wide: what it costs here
            probe = asyncio.run(closed_loop(stack.addr("gateway"), users, a.stack_probe, a.k, 1000.0, len(users.ids)))
            got = summarise(probe, np.zeros(len(users.ids)), len(users.ids), a.k)
            out["probe"] = {"policy": a.stack_probe, **{k: got[k] for k in keys if k in got}}
            say(f"{label}: {a.stack_probe} at 1 s: p50 {got['p50_ms']:.1f} ms, p99 {got['p99_ms']:.1f}, "
                f"max {got['max_ms']:.1f} (the gateway's own p50 {got['overhead_p50_ms']:.1f}), "
                f"served by {got['served_by']}")
        say(f"{label}: drafter modes {modes or 'all'}; started in "
            + ", ".join(f"{n} {t:.1f} s" for n, t in starts.items())
            + f"; auto at 30 ms: GR-ranked {closed['gr_ranked_share']:.3f}, served by {closed['served_by']}")
    finally:
        stack.stop(say=say)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = res["sizes"]
    xs = [s["items"] for s in sizes]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for p, color in zip(res["policies"], ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(xs, [s["policies"][p]["p50_ms"] for s in sizes], "o-", color=color, label=f"{p} p50")
        ax.plot(xs, [s["policies"][p]["p99_ms"] for s in sizes], "x--", color=color, alpha=0.6, label=f"{p} p99")
    ax.set_xscale("log")
    ax.set_xlabel("items in the catalogue")
    ax.set_ylabel("ms per request (in process, K = 10)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.plot(xs, [s["tables_mb"] for s in sizes], "o-", color="tab:purple", label="search tables (MB)")
    bx.plot(xs, [s["trie_mb"] for s in sizes], "s--", color="tab:gray", label="trie (MB)")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("items in the catalogue")
    bx.set_ylabel("MB")
    cx = bx.twinx()
    cx.plot(xs, [s["build_s"] for s in sizes], "^:", color="tab:red", label="build (s)")
    cx.set_ylabel("build s")
    bx.legend(loc="upper left", fontsize=8)
    cx.legend(loc="lower right", fontsize=8)
    fig.suptitle(textwrap.fill(res["title"], 160), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(res: dict) -> str:
    lines = ["# Cost against catalogue size", "", f"Command: `{res['command']}`", "", res["machine"], ""]
    if all("policies" in s for s in res["sizes"]):
        cols = ["items", "forms", "build s", "tables MB", "trie MB"]
        cols += [f"{p} p50 / p99 ms" for p in res["policies"]]
        lines += [res["users"], "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for s in res["sizes"]:
            cells = [f"{s['items']:,}", s["forms"], f"{s['build_s']:.2f}", f"{s['tables_mb']:.1f}",
                     f"{s['trie_mb']:.1f}"]
            cells += [f"{s['policies'][p]['p50_ms']:.2f} / {s['policies'][p]['p99_ms']:.2f}" for p in res["policies"]]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "![cost against catalogue size](catalogue_scale.png)", ""]
    if all("itemset" in s for s in res["sizes"]):
        cols = ["items", "load s", "Redis MB", "B/item", "upsert p50 / p99 ms", "item set's mirror s / MB",
                "packed MB / s", "follower s / MB", "delta ms"]
        lines += ["## The item set", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for s in res["sizes"]:
            i = s["itemset"]
            lines.append("| " + " | ".join([
                f"{s['items']:,}", f"{i['load_s']:.1f}", f"{i['redis_mb']:.0f}", f"{i['bytes_per_item']:.0f}",
                f"{i['upsert_p50_ms']:.2f} / {i['upsert_p99_ms']:.2f}",
                f"{i['mirror_load_s']:.1f} / {i['mirror_mb']:.0f}",
                f"{i['packed_mb']:.0f} / {i['pack_s']:.1f}", f"{i['follower_load_s']:.1f} / {i['follower_mb']:.0f}",
                f"{i['delta_apply_ms']:.0f}"]) + " |")
        lines.append("")
    if all("stack" in s for s in res["sizes"]):
        cols = ["items", "drafter modes", "start s (each service)", "auto GR-ranked share at 30 ms", "served by",
                "auto p50 / p99 / max ms", "kernel during auto: compaction stalls, major faults",
                "probe at 1 s: p50 / p99 ms (gateway's own p50)"]
        lines += ["## The stack", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for s in res["sizes"]:
            st = s["stack"]
            lines.append("| " + " | ".join([
                f"{s['items']:,}", st["drafter_modes"] or "all",
                ", ".join(f"{n} {t:.1f}" for n, t in st["start_s"].items()),
                f"{st['closed']['gr_ranked_share']:.3f}", str(st["closed"].get("served_by", "")),
                f"{st['closed']['p50_ms']:.1f} / {st['closed']['p99_ms']:.1f} / {st['closed']['max_ms']:.1f}",
                _kernel(st["closed"].get("kernel")), _probe(st.get("probe"))]) + " |")
        lines += ["", "The drafter serves once the bundle's rows are indexed; the rest are indexed in the background "
                  "(docs/catalogue.md).", ""]
    return "\n".join(lines)


def _kernel(k: dict | None) -> str:
    if not k:
        return "n/a"
    return f"{k.get('compact_stall', 0)}, {k.get('pgmajfault', 0)}"


def _probe(p: dict | None) -> str:
    if not p:
        return ""
    return f"{p['policy']}: {p['p50_ms']:.1f} / {p['p99_ms']:.1f} ({p['overhead_p50_ms']:.1f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--sizes", default="12k,100k,1m,10m", help="catalogue sizes (12k: the bundle's own)")
    ap.add_argument("--users", type=int, default=32, help="seeded random test histories (the same at every size)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds over the histories (one more to warm up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--exclude-history", action="store_true", help="requests exclude their history (a view)")
    ap.add_argument("--parts", default="inprocess", help=f"what to measure, of {', '.join(PARTS)}")
    ap.add_argument("--upserts", type=int, default=200, help="timed one-item upserts per size (--parts itemset)")
    ap.add_argument("--stack-users", type=int, default=300, help="seeded random test users (--parts stack)")
    ap.add_argument("--stack-drafter-modes", default="auto", help="the drafter's modes (SPECREC_DRAFTER_MODES; "
                    "'' = all the bundle has); auto: all up to 100k items, else the bundle's default")
    ap.add_argument("--stack-probe", default="", help="after auto, this policy through the same stack at a 1 s "
                    "budget (its p50/p99 there: why auto chose as it did)")
    ap.add_argument("--stack-timeout", type=float, default=900.0, help="seconds a service may take to start")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    import torch

    from specrec.bundle import Bundle

    torch.set_num_threads(1)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)} (known: {', '.join(PARTS)})")
    b = Bundle.load(a.bundle)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    if "fused" in policies and (b.sasrec is None or b.fusion is None):
        raise SystemExit(f"{a.bundle}: no SASRec with a fusion for the fused policy")
    users = sample_users(b, a.users, a.seed)
    backend = b.backend()
    vmax = max(b.cfg.level_sizes)
    res: dict = {"command": command_line("bench.catalogue_scale", argv), "machine": machine_line(in_process=True),
                 "run": run_line(),
                 "users": users.source + f", K = {a.k}, {a.rounds} timed rounds, history "
                 f"{'excluded' if a.exclude_history else 'not excluded'}", "backend": backend.describe(),
                 "policies": policies, "sizes": []}
    keys: dict = {}
    real = len(b.sids)
    sizes = []  # per size: its entry, its SIDs and seen flags, and its item set while the in-process part needs it
    for n in sorted(parse_size(s) for s in a.sizes.split(",")):
        label = label_of(n, real)
        say(f"{label}: drawing {max(0, n - real):,} synthetic SIDs")
        sids = synthetic_sids(b.sids, b.cfg.level_sizes, n, a.seed)
        seen = np.concatenate([b.seen, np.zeros(len(sids) - real, dtype=bool)])
        gc.collect()
        itemset, fig = build_tables(sids, seen, b.cfg.level_sizes, vmax)
        say(f"{label}: {fig['items']:,} items, tables {fig['forms']} {fig['tables_mb']:.1f} MB, trie "
            f"{fig['trie_mb']:.1f} MB, built in {fig['build_s']:.2f} s")
        keys[f"catalogue.{label}.tables_mb"], keys[f"catalogue.{label}.build_s"] = fig["tables_mb"], fig["build_s"]
        keys[f"catalogue.{label}.trie_mb"] = fig["trie_mb"]
        sizes.append(({"label": label, **fig}, sids, seen, itemset if "inprocess" in parts else None))
        del itemset
    if "inprocess" in parts:  # every size at once, its requests interleaved with the others' (time_policies)
        timed = time_policies({e["label"]: engine_over(b, backend, it) for e, _, _, it in sizes}, users.rows,
                              policies, a.k, a.rounds, a.exclude_history)
        for entry, _, _, _ in sizes:
            label = entry["label"]
            entry["policies"] = timed[label]
            say(f"{label}: " + ", ".join(f"{p} {v['p50_ms']:.2f}/{v['p99_ms']:.2f} ms"
                                         for p, v in entry["policies"].items()))
            for p, v in entry["policies"].items():
                keys[f"catalogue.{label}.{p}.p50_ms"], keys[f"catalogue.{label}.{p}.p99_ms"] = v["p50_ms"], v["p99_ms"]
        del timed
    sizes = [(entry, sids, seen) for entry, sids, seen, _ in sizes]  # the parts below start their own copies
    gc.collect()
    for entry, sids, seen in sizes:
        label = entry["label"]
        if "itemset" in parts:
            ids = list(b.catalogue.ids) + [f"synthetic-{i}" for i in range(len(sids) - real)]
            entry["itemset"] = itemset_part(label, sids, seen, ids, list(b.cfg.level_sizes), a)
            for name in ITEMSET_KEYS:
                keys[f"catalogue.{label}.itemset.{name}"] = entry["itemset"][name]
        if "stack" in parts:
            ids = list(b.catalogue.ids) + [f"synthetic-{i}" for i in range(len(sids) - real)]
            entry["stack"] = stack_part(label, sids, seen, ids, a.bundle, a)
            share = entry["stack"]["closed"]["gr_ranked_share"]
            keys[f"catalogue.{label}.gateway.auto.gr_ranked_share_at_30ms"] = share
            if probe := entry["stack"].get("probe"):
                keys[f"catalogue.{label}.gateway.{probe['policy']}.p50_ms_at_1s"] = probe["p50_ms"]
            for name, t in entry["stack"]["start_s"].items():
                keys[f"catalogue.{label}.start_s.{name}"] = t
        res["sizes"].append(entry)
        gc.collect()
    res["title"] = f"{b.name}: {res['users']}; {res['machine']}"
    out = Path(a.out)
    if "inprocess" in parts:
        out.mkdir(parents=True, exist_ok=True)
        plot(res, out / "catalogue_scale.png")
    publish(out, "catalogue_scale", res, markdown(res), keys)
    print(json.dumps(keys, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
