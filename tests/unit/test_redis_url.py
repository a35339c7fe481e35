"""Redis URLs (specrec_rpc/redis_url.py): the one parser every Redis client of SpecRec goes through."""

from __future__ import annotations

import pytest

from specrec_rpc.redis_url import RedisTarget, async_client, parse_redis_url, safe_url, sync_client


def test_sentinel_url_names_the_sentinels_the_master_and_the_db():
    t = parse_redis_url("redis+sentinel://h1:26379,h2:26380/mymaster/3")
    assert t == RedisTarget(url=t.url, sentinels=(("h1", 26379), ("h2", 26380)), master="mymaster", db=3)
    assert t.is_sentinel and not t.ssl


def test_sentinel_defaults_port_and_db_and_takes_ipv6():
    t = parse_redis_url("redis+sentinel://h1,[::1]:1234/m")
    assert t.sentinels == (("h1", 26379), ("::1", 1234)) and t.master == "m" and t.db == 0


def test_sentinel_password_from_the_url_is_unquoted_and_never_shown():
    t = parse_redis_url("rediss+sentinel://user:p%40ss%2Fw@h:1/m/0")
    assert (t.username, t.password, t.ssl) == ("user", "p@ss/w", True)
    assert "p@ss" not in repr(t) and "p%40ss" not in repr(t)
    assert parse_redis_url("redis+sentinel://:secret@h/m").password == "secret"
    assert safe_url("redis+sentinel://:secret@h1,h2/m") == "redis+sentinel://***@h1,h2/m"


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "rediss://:pw@host/1", "unix:///tmp/redis.sock"])
def test_plain_urls_pass_through(url):
    t = parse_redis_url(url)
    assert not t.is_sentinel and t.url == url


@pytest.mark.parametrize("url, fragment", [
    ("", "expected"),
    ("localhost:6379", "expected"),
    ("memcached://h", "unknown scheme"),
    ("redis+sentinel://h1:26379", "no master name"),
    ("redis+sentinel://h1:26379/", "no master name"),
    ("redis+sentinel://h1:26379/m/x", "not a number"),
    ("redis+sentinel://h1:26379/m/0/extra", "path must be"),
    ("redis+sentinel://h1:port/m", "bad port"),
    ("redis+sentinel://h1:70000/m", "out of range"),
    ("redis+sentinel://h1,,h2/m", "empty sentinel"),
    ("redis+sentinel://:26379/m", "no host"),
    ("redis+sentinel://h1/m?sentinel_password=x", "no parameters"),
])
def test_bad_urls_say_what_is_wrong(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_redis_url(url)


def test_bad_url_errors_do_not_leak_the_password():
    with pytest.raises(ValueError) as e:
        parse_redis_url("redis+sentinel://:topsecret@h1:x/m")
    assert "topsecret" not in str(e.value)


def test_clients_for_a_sentinel_url_ask_the_sentinels_with_their_own_password():
    c = async_client("redis+sentinel://h1:1,h2:2/mymaster/2", password="data-pw", sentinel_password="sent-pw",
                     socket_timeout=2.0, sentinel_timeout_s=0.5)
    pool = c.connection_pool
    assert pool.service_name == "mymaster" and pool.is_master
    assert pool.connection_kwargs["password"] == "data-pw" and pool.connection_kwargs["db"] == 2
    manager = pool.sentinel_manager
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in manager.sentinels] == [("h1", 1), ("h2", 2)]
    assert manager.min_other_sentinels == 1  # a sentinel cut off from the others is not believed
    skw = manager.sentinels[0].connection_pool.connection_kwargs
    assert skw["password"] == "sent-pw" and skw["socket_timeout"] == 0.5
    s = sync_client("redis+sentinel://:url-pw@h1/m", password="ignored")
    assert s.connection_pool.connection_kwargs["password"] == "url-pw"  # the URL's password wins


def test_a_plain_url_gets_the_settings_password_when_it_has_none():
    c = sync_client("redis://h:1/0", password="pw")
    assert c.connection_pool.connection_kwargs["password"] == "pw"


def test_cluster_and_sentinel_do_not_mix():
    with pytest.raises(ValueError, match="cannot be combined"):
        async_client("redis+sentinel://h/m", cluster=True)
