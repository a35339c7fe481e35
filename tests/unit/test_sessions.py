"""The verifier service's SessionStore: sessions by id, least recently used first out, idle ones expired."""

import pytest

from verifier_svc.sessions import SessionNotFound, SessionStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def store(ttl_s=10.0, max_sessions=8):
    clock = Clock()
    return SessionStore(ttl_s, max_sessions, clock), clock


def test_a_session_is_found_by_its_key_with_its_snapshot():
    s, _ = store()
    sess, snap = object(), object()
    key = s.add(sess, snap)
    other = s.add(object(), snap)
    assert key != other and len(s) == 2
    e = s.get(key)
    assert e.session is sess and e.snap is snap


def test_an_unknown_key_raises_session_not_found():
    s, _ = store()
    with pytest.raises(SessionNotFound, match="unknown or expired"):
        s.get("nope")
    assert issubclass(SessionNotFound, LookupError)


def test_pop_forgets_a_session_and_ignores_unknown_keys():
    s, _ = store()
    key = s.add(object(), object())
    s.pop(key)
    s.pop(key)  # a second release is not an error
    s.pop("nope")
    assert len(s) == 0
    with pytest.raises(SessionNotFound):
        s.get(key)


def test_beyond_max_sessions_the_least_recently_used_goes_first():
    s, _ = store(max_sessions=2)
    a = s.add(object(), object())
    b = s.add(object(), object())
    s.get(a)  # a is now the most recently used: b is the oldest
    c = s.add(object(), object())
    assert len(s) == 2
    s.get(a)
    s.get(c)
    with pytest.raises(SessionNotFound):
        s.get(b)


def test_expire_drops_sessions_idle_for_the_ttl_and_a_get_keeps_one_alive():
    s, clock = store(ttl_s=10.0)
    a = s.add(object(), object())
    clock.t = 5.0
    b = s.add(object(), object())
    clock.t = 8.0
    c = s.add(object(), object())
    clock.t = 12.0
    s.get(b)  # touched at 12
    assert s.expire() == 1  # a, idle since 0; b and c are younger than 10 s
    with pytest.raises(SessionNotFound):
        s.get(a)
    clock.t = 19.0
    assert s.expire() == 1  # c, idle since 8; b was touched at 12
    s.get(b)
    with pytest.raises(SessionNotFound):
        s.get(c)
    assert s.expire() == 0 and len(s) == 1

