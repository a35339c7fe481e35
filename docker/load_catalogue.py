#!/opt/venv/bin/python
"""Bulk-load a bundle's catalogue into Redis, by default only into an empty namespace.

    specrec-load-catalogue [--if-empty] [--wait-redis 120] --bundle DIR [python -m itemset_svc.load flags]

A thin wrapper around ``python -m itemset_svc.load`` for one-shot loader
containers (the Compose ``catalogue-loader`` service and the Helm
post-install/post-upgrade Job), which run on every ``up`` / upgrade:

- waits for Redis (``--wait-redis`` seconds) instead of failing at once;
- with ``--if-empty`` it loads only when the namespace has no catalogue yet,
  holding the same ``loading`` lock the item-set service takes for its own
  ``load_if_empty``, so the two never load twice. Without it every run
  publishes the bundle's catalogue as a new current version, and items
  upserted since (not in the bundle) are no longer in the current version
  (they stay in older versions until pruned: Rollback reaches them);
- everything else (``--bundle``, ``--redis-url``, ``--namespace``, ``--force`` ...)
  is passed to ``itemset_svc.load`` unchanged.

Prints one JSON line; exit 0 when the catalogue is loaded or was already there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

LOCK = "loading"  # the lock ItemSetService._prepare takes around its own bulk load
LOCK_TTL_S = 900.0


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    from itemset_svc.settings import ItemSetSettings

    defaults = ItemSetSettings()  # SPECREC_ITEMSET_* from the environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    ap.add_argument("--if-empty", action="store_true", help="load only when the namespace has no catalogue")
    ap.add_argument("--wait-redis", type=float, default=120.0, help="seconds to wait for Redis (default %(default)s)")
    ap.add_argument("--redis-url", default=defaults.redis_url)
    ap.add_argument("--namespace", default=defaults.namespace)
    ap.add_argument("--timeout", type=float, default=30.0)
    a, rest = ap.parse_known_args(argv)
    a.settings = defaults  # passwords, cluster, durability: SPECREC_ITEMSET_* as the item set reads them
    # itemset_svc.load gets the connection flags too
    rest = [*rest, "--redis-url", a.redis_url, "--namespace", a.namespace, "--timeout", str(a.timeout)]
    return a, rest


async def _store(a):
    from itemset_svc.store import REDIS_DOWN, RedisCatalogue

    store = RedisCatalogue.from_settings(a.settings, a.namespace, url=a.redis_url, timeout_s=a.timeout)
    deadline = time.monotonic() + a.wait_redis
    while True:
        try:
            await store.state()
            return store
        except REDIS_DOWN as e:
            if time.monotonic() > deadline:
                await store.close()
                raise
            print(f"waiting for Redis: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            await asyncio.sleep(2.0)


async def _lock_and_check(a) -> tuple[str | None, str | None]:
    """(lock token, current version): waits for the lock the item-set service may hold."""
    store = await _store(a)
    try:
        deadline = time.monotonic() + LOCK_TTL_S
        while True:
            token = await store.try_lock(LOCK, LOCK_TTL_S)
            if token is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the catalogue 'loading' lock is still held")
            print("another process is loading the catalogue; waiting", file=sys.stderr, flush=True)
            await asyncio.sleep(2.0)
        cur, _ = await store.state()
        if cur is not None:
            await store.unlock(LOCK, token)
            return None, cur
        return token, None
    finally:
        await store.close()


async def _wait(a) -> None:
    store = await _store(a)
    await store.close()


async def _unlock(a, token: str) -> None:
    store = await _store(a)
    try:
        await store.unlock(LOCK, token)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    from itemset_svc import load
    from specrec_rpc.redis_url import safe_url

    a, rest = _parse(list(sys.argv[1:] if argv is None else argv))
    if not a.if_empty:
        try:
            asyncio.run(_wait(a))
        except Exception as e:  # noqa: BLE001 - a CLI: one clear line
            print(f"error: Redis at {safe_url(a.redis_url)} unreachable: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        return load.main(rest)
    try:
        token, cur = asyncio.run(_lock_and_check(a))
    except Exception as e:  # noqa: BLE001
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if cur is not None:
        print(json.dumps({"namespace": a.namespace, "version": cur, "loaded": False,
                          "reason": "namespace already holds a catalogue (--if-empty)"}))
        return 0
    try:
        return load.main(rest)
    finally:
        asyncio.run(_unlock(a, token))


if __name__ == "__main__":
    sys.exit(main())
