"""``worker.console.sessions`` against a user who logs in again and again (a script with a
read-only token): the store's bound on sessions must not let one user's logins end another's.
Found in review."""

from __future__ import annotations

from worker.console.accounts import Role, User
from worker.console.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_USER, Sessions

OPERATOR = User("olivia", Role.OPERATOR)
VIEWER = User("victor", Role.VIEWER)


def test_one_user_logging_in_past_the_store_s_bound_ends_only_their_own_sessions() -> None:
    # Given an operator logged in, in a store of the default size
    store = Sessions()
    operator_cookie, _ = store.start(OPERATOR)

    # When a viewer logs in more times than the store holds sessions
    viewer_cookies = [store.start(VIEWER)[0] for _ in range(MAX_SESSIONS + 10)]

    # Then the operator's session lives on: the viewer's logins ended the viewer's own
    assert store.find(operator_cookie) is not None
    kept = [cookie for cookie in viewer_cookies if store.find(cookie) is not None]
    assert kept == viewer_cookies[-MAX_SESSIONS_PER_USER:]
    assert len(store) == 1 + MAX_SESSIONS_PER_USER


def test_a_user_s_sessions_past_their_bound_end_their_least_recently_seen_first() -> None:
    # Given a user with as many sessions as a user may hold, the first used just now
    store = Sessions(max_per_user=3)
    cookies = [store.start(VIEWER)[0] for _ in range(3)]
    assert store.find(cookies[0]) is not None

    # When they log in once more
    newest, _ = store.start(VIEWER)

    # Then their least recently seen session (the second) ended, and no other
    assert store.find(cookies[1]) is None
    for cookie in (cookies[0], cookies[2], newest):
        assert store.find(cookie) is not None
