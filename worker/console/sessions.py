"""Logged-in browsers, kept in the console process's memory.

Invariant: the cookie carries a random 256-bit id and nothing else; the store keeps only its
SHA-256, so a dump of the process's memory holds no usable cookie. A session ends after
``IDLE_TIMEOUT`` without a request, ``LIFETIME`` after its login, or at logout, whichever comes
first; the store holds at most ``MAX_SESSIONS`` (a new login then ends the oldest), and at most
``MAX_SESSIONS_PER_USER`` of one user (a user's new login then ends their own oldest), so no
user's logins, however many, end another user's session. Each session
has its own CSRF token, compared in constant time. A restart of the console ends every session.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from worker.console.accounts import User

LIFETIME = 8 * 3600.0
"""Seconds a session lasts at most after its login."""
IDLE_TIMEOUT = 30 * 60.0
"""Seconds a session lasts without a request (the overview's refresh counts as one)."""
MAX_SESSIONS = 1024
"""Sessions kept at most; the oldest ends when a login would pass it."""
MAX_SESSIONS_PER_USER = 32
"""Sessions of one user (one token entry's name) kept at most; their oldest ends when their
login would pass it, before ``MAX_SESSIONS`` is reached by one user alone."""


@dataclass
class Session:
    """One logged-in browser."""

    user: User
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    started: float = field(default_factory=time.monotonic)
    seen: float = field(default_factory=time.monotonic)
    last_refusal: tuple[str, str, int] | None = None
    """(action, outcome, audit entry id) of the session's last refused action."""

    def csrf_matches(self, sent: str | None) -> bool:
        """Whether ``sent`` is this session's CSRF token (in constant time)."""
        return sent is not None and hmac.compare_digest(
            sent.encode("utf-8", "replace"), self.csrf.encode("ascii")
        )


class Sessions:
    """The sessions of this console process, by the digest of their cookie."""

    def __init__(
        self,
        *,
        lifetime: float = LIFETIME,
        idle_timeout: float = IDLE_TIMEOUT,
        max_sessions: int = MAX_SESSIONS,
        max_per_user: int = MAX_SESSIONS_PER_USER,
    ) -> None:
        self.lifetime = lifetime
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.max_per_user = max_per_user
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()

    def start(self, user: User) -> tuple[str, Session]:
        """A new session for ``user``: (the cookie's value, the session)."""
        cookie = secrets.token_urlsafe(32)
        session = Session(user)
        theirs = [key for key, kept in self._sessions.items() if kept.user.name == user.name]
        for key in theirs[: max(0, len(theirs) - self.max_per_user + 1)]:
            del self._sessions[key]  # (their least recently seen first)
        self._sessions[_digest(cookie)] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return cookie, session

    def find(self, cookie: str | None) -> Session | None:
        """The live session ``cookie`` names (and it is seen now), or None."""
        if not cookie:
            return None
        key = _digest(cookie)
        session = self._sessions.get(key)
        if session is None:
            return None
        now = time.monotonic()
        if now - session.started > self.lifetime or now - session.seen > self.idle_timeout:
            del self._sessions[key]
            return None
        session.seen = now
        self._sessions.move_to_end(key)
        return session

    def live(self, cookie: str | None) -> bool:
        """Whether ``cookie`` names a live session (which is not seen by this: a request
        refused before its page runs does not keep a session alive)."""
        session = self._sessions.get(_digest(cookie)) if cookie else None
        if session is None:
            return False
        now = time.monotonic()
        return now - session.started <= self.lifetime and now - session.seen <= self.idle_timeout

    def end(self, cookie: str | None) -> None:
        """End the session ``cookie`` names, if any."""
        if cookie:
            self._sessions.pop(_digest(cookie), None)

    def __len__(self) -> int:
        return len(self._sessions)


def _digest(cookie: str) -> bytes:
    return hashlib.sha256(cookie.encode("utf-8", "replace")).digest()
