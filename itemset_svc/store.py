"""The catalogue in Redis: versioned, immutable once published.

:class:`RedisCatalogue` is one namespace's catalogue: the key schema is in
:mod:`.keys`, reads in :mod:`.reads`, writes (upsert, delete, rollback) in
:mod:`.writes`, how a write becomes a published version in :mod:`.publish`,
the bulk load in :mod:`.bulk`, the client and the errors that mean Redis is
down in :mod:`.client`. This module joins them, and holds the named locks the
replicas share.
Storage code raises plain domain errors (:class:`VersionNotFound`,
:class:`WriteConflict`, ...) and never imports gRPC; the service maps them to
status codes (:mod:`specrec_rpc.errors`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog

from specrec_rpc.redis_url import close_async

from .bulk import CatalogueBulkLoad
from .client import REDIS_DOWN, make_client  # noqa: F401 (re-exported)
from .keys import Keys, Record, parse_sid, prefix_steps, sid_str  # noqa: F401 (re-exported)
from .metrics import REDIS_SECONDS
from .publish import _COMMIT, _DROP, _FOLD, NotAcknowledged, WriteConflict, WriteRejected, WriteResult  # noqa: F401 (re-exported)
from .reads import CatalogueEmpty, CatalogueInfo, CatalogueReads, VersionNotFound  # noqa: F401 (re-exported)
from .settings import check_namespace
from .writes import CatalogueWrites, UpsertSpec  # noqa: F401 (re-exported)

# KEYS: the lock; ARGV: token. Deletes the lock only if we still hold it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisCatalogue(CatalogueReads, CatalogueWrites, CatalogueBulkLoad):
    """Every read and write of one namespace's catalogue (see :mod:`.keys` for the schema)."""

    def __init__(self, client, namespace: str = "specrec", keep_versions: int = 3,
                 default_level_sizes: Sequence[int] | None = None, max_attempts: int = 3, *,
                 write_replicas: int = -1, write_wait_s: float = 1.0, timeout_s: float = 2.0,
                 cluster: bool = False, sentinel: bool = False):
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        if cluster and write_replicas > 0:
            raise ValueError("write_replicas > 0 needs a standalone or Sentinel-managed Redis, not redis_cluster")
        self.r = client
        # durability: WAIT for this many replicas after each publish (-1: 1 when the primary has one, else 0)
        self.write_replicas = int(write_replicas)
        self.wait_ms = max(1, int(min(write_wait_s, 0.8 * timeout_s) * 1000))
        self.cluster = cluster
        # replicated: a version older than one this process saw is a failover that dropped writes that were
        # never acknowledged, not a loss (see CatalogueIntegrity._lost); learned from the URL, the setting, or
        # a primary seen with replicas
        self.replicated = sentinel or self.write_replicas > 0
        self.ns = check_namespace(namespace)
        self.keys = Keys(namespace)
        self.keep = int(keep_versions)
        self.default_level_sizes = list(default_level_sizes) if default_level_sizes else None
        self.max_attempts = max_attempts
        self._lock = asyncio.Lock()
        self._commit = self.r.register_script(_COMMIT)
        self._unlock = self.r.register_script(_UNLOCK)
        self._drop_staged = self.r.register_script(_DROP)
        self._fold = self.r.register_script(_FOLD)
        self._layouts = {}
        self.log = structlog.get_logger("itemset.store").bind(namespace=namespace)

    @classmethod
    def from_url(cls, url: str, namespace: str = "specrec", timeout_s: float = 2.0, cluster: bool = False, *,
                 password: str | None = None, sentinel_password: str | None = None, **kw):
        from specrec_rpc.redis_url import parse_redis_url

        sentinel = parse_redis_url(url).is_sentinel
        return cls(make_client(url, timeout_s, cluster, password, sentinel_password), namespace, timeout_s=timeout_s,
                   cluster=cluster, sentinel=sentinel, **kw)

    @classmethod
    def from_settings(cls, s, namespace: str | None = None, url: str | None = None, timeout_s: float | None = None,
                      **kw):
        """The store of :class:`~.settings.ItemSetSettings` ``s`` (URL, passwords, durability), with overrides."""
        return cls.from_url(url or s.redis_url, namespace or s.namespace,
                            timeout_s=s.redis_timeout_s if timeout_s is None else timeout_s, cluster=s.redis_cluster,
                            password=s.redis_password.get_secret_value() or None,
                            sentinel_password=s.redis_sentinel_password.get_secret_value() or None,
                            write_replicas=s.write_replicas, write_wait_s=s.write_wait_s, **kw)

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
        await close_async(self.r)

    # -- named locks: one replica loads or restores, the others wait ----------------------------
    async def try_lock(self, name: str, ttl_s: float) -> str | None:
        token = f"{time.time():.6f}-{id(self)}"
        ok = await self.r.set(self.keys.key(name), token, nx=True, px=int(ttl_s * 1000))
        return token if ok else None

    async def unlock(self, name: str, token: str) -> None:
        await self._unlock(keys=[self.keys.key(name)], args=[token])
