"""The Redis connection: a bounded-timeout client for any URL, and the errors that mean Redis is unreachable.

Shared by :mod:`.store` (which builds the client) and :mod:`.writes` (which retries or tolerates a write
around an outage), so neither imports the other.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specrec_rpc.redis_url import async_client

# Redis down, slow, restarting, or (a Sentinel client) no primary known: UNAVAILABLE, and a write may retry
# (MasterNotFoundError and "the previous master is now a slave" are ConnectionErrors)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError, asyncio.TimeoutError)


def make_client(url: str, timeout_s: float = 2.0, cluster: bool = False, password: str | None = None,
                sentinel_password: str | None = None):
    """A ``redis.asyncio`` client for any URL of :mod:`specrec_rpc.redis_url`, with bounded timeouts: one
    quick retry on a connection error (a pooled connection may be stale after a Redis restart or a
    failover), none on a timeout, so a hung Redis costs one ``timeout_s``, not several. Sentinels are
    asked with at most a 1 s timeout each, so a dead one costs little before the next is asked."""
    kw: dict[str, Any] = dict(decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
              retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1, supported_errors=(RedisConnectionError,)),
              health_check_interval=30)
    return async_client(url, cluster=cluster, password=password, sentinel_password=sentinel_password,
                        sentinel_timeout_s=min(timeout_s, 1.0), **kw)
