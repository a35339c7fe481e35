"""Redis URLs, in one place: parse them, and open clients for them.

Everything that talks to Redis (the item set, its bulk loader, the
catalogue-loader container, the local stack's checks) goes through here, so
they all accept the same URLs:

    redis://[[user]:password@]host:port[/db]          a standalone server (redis-py's own forms:
    rediss://...  unix:///path/redis.sock?db=0          TLS, a Unix socket)
    redis+sentinel://[[user]:password@]h1:26379,h2:26379/mymaster[/db]
    rediss+sentinel://...                              the same, TLS to the servers and the sentinels

A Sentinel URL names the sentinels (port 26379 when omitted) and the master
name; redis-py's :class:`~redis.sentinel.Sentinel` asks them for the primary
before every new connection, so after a failover the client reconnects to the
new primary (a connection still open to a demoted primary is dropped on its
first READONLY answer). The URL's password is the data servers' (``AUTH``);
the sentinels' own password, when they have one, is given apart
(``sentinel_password``). Passwords may also come from settings instead of the
URL (``password``): the URL's wins. When several sentinels are listed, one
that sees no other sentinel is not asked (it may be cut off and name a primary
the others have replaced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL points at."""

    url: str = field(repr=False)  # the URL as given (it may hold a password)
    sentinels: tuple[tuple[str, int], ...] = ()  # empty: a standalone server (or a cluster entry node)
    master: str = ""  # the Sentinel master name
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)


def _host_port(part: str, url: str) -> tuple[str, int]:
    part = part.strip()
    if not part:
        raise ValueError(f"redis url {safe_url(url)!r}: an empty sentinel address")
    if part.startswith("["):  # [::1]:26379
        host, _, rest = part[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise ValueError(f"redis url {safe_url(url)!r}: sentinel address {part!r} has no host")
    try:
        p = int(port) if port else SENTINEL_PORT
    except ValueError:
        raise ValueError(f"redis url {safe_url(url)!r}: sentinel address {part!r} has a bad port") from None
    if not 0 < p < 65536:
        raise ValueError(f"redis url {safe_url(url)!r}: sentinel port {p} out of range")
    return host, p


def parse_redis_url(url: str) -> RedisTarget:
    """Parse ``url``; a ValueError names what is wrong (never the password)."""
    if not url or "://" not in url:
        raise ValueError(f"redis url {safe_url(url)!r}: expected redis://, rediss://, unix:// or redis+sentinel://")
    scheme = url.split("://", 1)[0].lower()
    if scheme in PLAIN_SCHEMES:
        return RedisTarget(url=url, ssl=scheme == "rediss")
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"redis url {safe_url(url)!r}: unknown scheme {scheme!r} (redis, rediss, unix, "
                         f"redis+sentinel, rediss+sentinel)")
    # a comma-separated host list is no netloc urllib can split: by hand
    rest = url.split("://", 1)[1]
    netloc, _, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None  # redis://name@host: a user name without a password, as redis-py reads it
        password = unquote(pw) if colon else None
    sentinels = tuple(_host_port(p, url) for p in hosts.split(","))
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"redis url {safe_url(url)!r}: no master name (redis+sentinel://host:26379/<master>[/db])")
    if len(parts) > 2:
        raise ValueError(f"redis url {safe_url(url)!r}: path must be /<master>[/db]")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"redis url {safe_url(url)!r}: database {parts[1]!r} is not a number")
        db = int(parts[1])
    if query:
        raise ValueError(f"redis url {safe_url(url)!r}: a Sentinel URL takes no parameters (passwords go in the URL "
                         f"or the settings)")
    return RedisTarget(url=url, sentinels=sentinels, master=parts[0], db=db, username=username, password=password,
                       ssl=scheme == "rediss+sentinel")


def safe_url(url: str) -> str:
    """The URL without its password (for logs and error messages)."""
    if url and "@" in url and "://" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _common(target: RedisTarget, password: str | None, username: str | None, kw: dict) -> dict:
    kw = dict(kw)
    pw = target.password if target.password is not None else (password or None)
    if pw is not None:
        kw["password"] = pw
    user = target.username or username
    if user:
        kw["username"] = user
    return kw


def _sentinel_kwargs(target: RedisTarget, kw: dict, sentinel_password: str | None, sentinel_timeout_s: float | None):
    skw: dict[str, Any] = {k: v for k, v in kw.items() if k.startswith("socket_")}
    if sentinel_timeout_s is not None:
        skw["socket_timeout"] = skw["socket_connect_timeout"] = sentinel_timeout_s
    if sentinel_password:
        skw["password"] = sentinel_password
    if target.ssl:
        skw["ssl"] = True
    if "decode_responses" in kw:
        skw["decode_responses"] = kw["decode_responses"]
    return skw


def _peers(target: RedisTarget) -> int:
    """Peers a sentinel must see for its answer to count: with several listed, a sentinel cut off from the
    others (which may still name a primary the majority has already replaced) is not believed."""
    return 1 if len(target.sentinels) > 1 else 0


def async_client(url: str, *, cluster: bool = False, password: str | None = None, username: str | None = None,
                 sentinel_password: str | None = None, sentinel_timeout_s: float | None = None, **kw):
    """A ``redis.asyncio`` client for ``url`` (a Sentinel URL: the master's client, ``master_for``)."""
    import redis.asyncio as aioredis

    target = parse_redis_url(url)
    kw = _common(target, password, username, kw)
    if target.is_sentinel:
        if cluster:
            raise ValueError("redis_cluster cannot be combined with a redis+sentinel:// URL")
        from redis.asyncio.sentinel import Sentinel

        skw = _sentinel_kwargs(target, kw, sentinel_password, sentinel_timeout_s)
        sentinel = Sentinel(list(target.sentinels), min_other_sentinels=_peers(target), sentinel_kwargs=skw, **kw)
        if target.ssl:
            return sentinel.master_for(target.master, db=target.db, ssl=True)
        return sentinel.master_for(target.master, db=target.db)
    if cluster:
        return aioredis.RedisCluster.from_url(url, **kw)
    return aioredis.from_url(url, **kw)


def sync_client(url: str, *, password: str | None = None, username: str | None = None,
                sentinel_password: str | None = None, **kw):
    """A blocking ``redis.Redis`` client for ``url`` (the local stack's checks and clean-ups)."""
    import redis

    target = parse_redis_url(url)
    kw = _common(target, password, username, kw)
    if target.is_sentinel:
        from redis.sentinel import Sentinel

        skw = _sentinel_kwargs(target, kw, sentinel_password, None)
        sentinel = Sentinel(list(target.sentinels), min_other_sentinels=_peers(target), sentinel_kwargs=skw, **kw)
        if target.ssl:
            return sentinel.master_for(target.master, db=target.db, ssl=True)
        return sentinel.master_for(target.master, db=target.db)
    return redis.Redis.from_url(url, **kw)


async def close_async(client) -> None:
    """Close a client from :func:`async_client`, its Sentinel connections included."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None:
        await manager.aclose()


def close_sync(client) -> None:
    client.close()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    if manager is not None:
        for s in manager.sentinels:
            s.close()
