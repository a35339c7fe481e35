"""The catalogue in Redis: versioned, immutable once published.

:class:`RedisCatalogue` is one namespace's catalogue: the key schema is in
:mod:`.keys`, reads in :mod:`.reads`, writes in :mod:`.writes`. This module
joins them and holds the connection plumbing. Storage code raises plain
domain errors (:class:`VersionNotFound`, :class:`WriteConflict`, ...) and
never imports gRPC; the service maps them to status codes
(:mod:`specrec_rpc.errors`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from .keys import Keys, Record, build_masks, parse_sid, prefix_steps, records_fingerprint, sid_str  # noqa: F401 (re-exported)
from .metrics import REDIS_SECONDS
from .reads import CatalogueEmpty, CatalogueInfo, CatalogueReads, VersionNotFound  # noqa: F401 (re-exported)
from .settings import check_namespace
from .writes import _COMMIT, _UNLOCK, CatalogueWrites, UpsertSpec, WriteConflict, WriteRejected, WriteResult  # noqa: F401

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError, asyncio.TimeoutError)


def make_client(url: str, timeout_s: float = 2.0, cluster: bool = False):
    """A ``redis.asyncio`` client with bounded timeouts: one quick retry on a
    connection error (a pooled connection may be stale after a Redis restart),
    none on a timeout, so a hung Redis costs one ``timeout_s``, not several."""
    kw = dict(decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
              retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1, supported_errors=(RedisConnectionError,)),
              health_check_interval=30)
    if cluster:
        return aioredis.RedisCluster.from_url(url, **kw)
    return aioredis.from_url(url, **kw)


class RedisCatalogue(CatalogueReads, CatalogueWrites):
    """Every read and write of one namespace's catalogue (see :mod:`.keys` for the schema)."""

    def __init__(self, client, namespace: str = "specrec", keep_versions: int = 3,
                 default_level_sizes: Sequence[int] | None = None, max_attempts: int = 3):
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.r = client
        self.ns = check_namespace(namespace)
        self.keys = Keys(namespace)
        self.keep = int(keep_versions)
        self.default_level_sizes = list(default_level_sizes) if default_level_sizes else None
        self.max_attempts = max_attempts
        self._lock = asyncio.Lock()
        self._commit = self.r.register_script(_COMMIT)
        self._unlock = self.r.register_script(_UNLOCK)
        self.log = structlog.get_logger("itemset.store").bind(namespace=namespace)

    @classmethod
    def from_url(cls, url: str, namespace: str = "specrec", timeout_s: float = 2.0, cluster: bool = False, **kw):
        return cls(make_client(url, timeout_s, cluster), namespace, **kw)

    # -- keys (kept for callers outside the store) ---------------------------------------
    @property
    def tag(self) -> str:
        return self.keys.tag

    @property
    def channel(self) -> str:
        return self.keys.channel

    def key(self, name: str) -> str:
        return self.keys.key(name)

    def vkey(self, version: str, name: str) -> str:
        return self.keys.vkey(version, name)

    def version_keys(self, version: str) -> list[str]:
        return self.keys.version_keys(version)

    # -- plumbing -----------------------------------------------------------------
    async def _t(self, op: str, aw):
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            REDIS_SECONDS.labels(op).observe(time.perf_counter() - t0)

    def pipe(self, transaction: bool = True):
        return self.r.pipeline(transaction=transaction)

    async def ping(self) -> bool:
        return bool(await self._t("ping", self.r.ping()))

    async def close(self) -> None:
        await self.r.aclose()
