"""The console's pure parts against what review found: ``worker.console.sessions`` against a
user who logs in again and again (a script with a read-only token), whose logins must not end
another user's sessions; ``templating.visible`` against every character that shows nothing
(tags, format characters, fillers), which a message's key or body could hide text behind."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from worker.console.accounts import Role, User
from worker.console.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_USER, Sessions
from worker.console.templating import visible

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


def test_every_control_format_or_line_separating_character_is_shown_as_an_escape() -> None:
    # Given every character Unicode calls a control, a format character or a line or paragraph
    # separator (but tab and newline, which a body may well hold)
    hidden = [
        chr(code)
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) in {"Cc", "Cf", "Zl", "Zp"} and chr(code) not in "\t\n"
    ]
    # When each is shown between two letters, then none is left as it is
    left = [char for char in hidden if char in visible(f"a{char}b")]
    assert left == [], [f"U+{ord(char):04X}" for char in left]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        # a key followed by Unicode tags (invisible: "ASCII smuggling")
        ("k1\U000e0041\U000e0042", "k1\\U000e0041\\U000e0042"),
        # a word joiner and an invisible separator, a soft hyphen
        ("gnp\u2060.exe\u2063\xad", "gnp\\u2060.exe\\u2063\\u00ad"),
        # a Hangul filler and a variation selector, which render as nothing
        ("a\u3164b\ufe0fc", "a\\u3164b\\ufe0fc"),
        # what was escaped before stays so, and tab and newline stay themselves
        ("x\u202ey\x1b\tz\n", "x\\u202ey\\u001b\tz\n"),
    ],
)
def test_invisible_characters_are_shown_as_escapes(text: str, shown: str) -> None:
    assert visible(text) == shown
