"""``worker.console.sessions``: a session ends after its idle timeout or its lifetime, the store
holds at most ``max_sessions`` (the least recently seen goes first), and what the store keeps
is the cookie's digest, never the cookie. Time passes by moving a session's timestamps back, as
the integration tests move them in SQL: nothing here sleeps."""

from __future__ import annotations

import pickle

import pytest

from worker.console.accounts import Role, User
from worker.console.sessions import IDLE_TIMEOUT, LIFETIME, MAX_SESSIONS, Session, Sessions

OPERATOR = User("olivia", Role.OPERATOR)
VIEWER = User("victor", Role.VIEWER)


def test_a_started_session_is_found_by_its_cookie_and_by_nothing_else() -> None:
    # Given a store with one session
    store = Sessions()
    cookie, session = store.start(OPERATOR)

    # Then its cookie finds it, and no other value does
    assert store.find(cookie) is session
    assert session.user == OPERATOR
    for other in (None, "", cookie[:-1], cookie + "x", cookie.upper(), "not-a-cookie"):
        assert store.find(other) is None, other


def test_a_session_ends_after_its_idle_timeout() -> None:
    # Given a store whose sessions end after a minute without a request
    store = Sessions(idle_timeout=60.0)
    cookie, session = store.start(VIEWER)

    # When its last request was 61 seconds ago
    session.seen -= 61.0

    # Then the cookie no longer finds it, and the store has forgotten it
    assert store.find(cookie) is None
    assert len(store) == 0
    # (not even when the clock would seem fine again)
    session.seen += 61.0
    assert store.find(cookie) is None


def test_a_request_within_the_idle_timeout_keeps_the_session_alive() -> None:
    # Given a session idle for 50 of its 60 seconds
    store = Sessions(idle_timeout=60.0)
    cookie, session = store.start(VIEWER)
    session.seen -= 50.0
    session.started -= 50.0

    # When it is used, and 50 more seconds pass
    assert store.find(cookie) is session
    session.seen -= 50.0
    session.started -= 50.0

    # Then it is still alive: the timeout counts from its last request, not from its login
    assert store.find(cookie) is session


def test_a_session_ends_after_its_lifetime_however_busy() -> None:
    # Given a session used a moment ago but logged in longer ago than its lifetime
    store = Sessions(lifetime=3600.0, idle_timeout=60.0)
    cookie, session = store.start(OPERATOR)
    session.started -= 3601.0

    # Then it has ended
    assert store.find(cookie) is None
    assert len(store) == 0


def test_a_logout_ends_only_its_own_session() -> None:
    store = Sessions()
    first, _ = store.start(OPERATOR)
    second, kept = store.start(OPERATOR)

    # When the first is ended (and nonsense is ended too)
    store.end(first)
    store.end(None)
    store.end("not-a-cookie")

    # Then only the first is gone
    assert store.find(first) is None
    assert store.find(second) is kept
    assert len(store) == 1


def test_past_max_sessions_a_login_ends_the_least_recently_seen() -> None:
    # Given a store of at most three sessions, full
    store = Sessions(max_sessions=3)
    cookies = [store.start(VIEWER)[0] for _ in range(3)]
    # and the oldest was used just now, so the second is the least recently seen
    assert store.find(cookies[0]) is not None

    # When a fourth logs in
    newest, _ = store.start(OPERATOR)

    # Then the store holds three, and the second is the one that ended
    assert len(store) == 3
    assert store.find(cookies[1]) is None
    for cookie in (cookies[0], cookies[2], newest):
        assert store.find(cookie) is not None


def test_a_thousand_logins_keep_the_store_bounded() -> None:
    store = Sessions(max_sessions=10)
    cookies = [store.start(VIEWER)[0] for _ in range(1000)]

    assert len(store) == 10
    assert all(store.find(cookie) is not None for cookie in cookies[-10:])
    assert all(store.find(cookie) is None for cookie in cookies[:-10])


def test_the_store_keeps_no_cookie_value() -> None:
    # Given a store with sessions
    store = Sessions()
    cookies = [store.start(user)[0] for user in (OPERATOR, VIEWER, OPERATOR)]

    # Then nothing it holds (keys, sessions, users: the whole object serialized) contains a
    # cookie, in any encoding: a dump of the process's memory gives no usable cookie
    held = pickle.dumps(store)
    for cookie in cookies:
        assert cookie.encode() not in held
        assert cookie not in repr(vars(store))
    # and a session's CSRF token is not its cookie
    assert all(session.csrf not in cookies for session in vars(store)["_sessions"].values())


def test_cookies_and_csrf_tokens_are_random_and_long() -> None:
    store = Sessions()
    started = [store.start(VIEWER) for _ in range(50)]
    cookies = {cookie for cookie, _ in started}
    tokens = {session.csrf for _, session in started}

    assert len(cookies) == 50
    assert len(tokens) == 50
    # 32 random bytes each, base64url: 43 characters
    assert all(len(value) >= 43 for value in cookies | tokens)


@pytest.mark.parametrize(
    ("sent", "matches"),
    [
        ("right", True),
        (None, False),
        ("", False),
        ("wrong", False),
        ("right ", False),
        ("rïght", False),
        ("\x00", False),
    ],
)
def test_a_csrf_token_matches_only_itself(sent: str | None, matches: bool) -> None:
    session = Session(OPERATOR)
    token = session.csrf
    if sent is not None:
        sent = sent.replace("right", token)

    assert session.csrf_matches(sent) is matches


def test_the_defaults_are_the_documented_ones() -> None:
    """docs/console.md states them: change both together."""
    assert (IDLE_TIMEOUT, LIFETIME, MAX_SESSIONS) == (30 * 60.0, 8 * 3600.0, 1024)
    store = Sessions()
    assert (store.idle_timeout, store.lifetime, store.max_sessions) == (
        IDLE_TIMEOUT,
        LIFETIME,
        MAX_SESSIONS,
    )
