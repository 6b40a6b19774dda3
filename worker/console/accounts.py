"""Who may log in to the console and what they may do: ``console_viewer_tokens`` are read-only,
``console_operator_tokens`` may act.

Invariant: a token is compared in constant time, through the ingress's ``Tokens`` (SHA-256
digests compared with ``hmac.compare_digest``, every accepted token compared), so the time a
login takes tells nothing of the tokens. A token in both lists is an operator's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from worker.errors import ConfigurationError
from worker.ingress.auth import Tokens
from worker.settings import Settings


class Role(enum.StrEnum):
    """What a console user may do."""

    VIEWER = "viewer"
    """Sees every page; acts on nothing."""
    OPERATOR = "operator"
    """Sees every page, and replays, purges, retries, hurries and cancels."""


@dataclass(frozen=True)
class User:
    """A logged-in console user: the name its token entry gives, and its role."""

    name: str
    role: Role

    @property
    def may_act(self) -> bool:
        return self.role is Role.OPERATOR


class Accounts:
    """The console's tokens, by role."""

    def __init__(self, viewers: tuple[str, ...], operators: tuple[str, ...]) -> None:
        self._operators = Tokens(operators) if operators else None
        self._viewers = Tokens(viewers) if viewers else None

    @classmethod
    def of(cls, settings: Settings) -> Accounts:
        """The accounts of ``settings``; a ``ConfigurationError`` when there are none (the
        console never runs open)."""
        if not settings.console_viewer_tokens and not settings.console_operator_tokens:
            raise ConfigurationError(
                "the console needs at least one token to log in with: set "
                "WORKER_CONSOLE_OPERATOR_TOKENS (or WORKER_CONSOLE_VIEWER_TOKENS for read-only "
                "users) to name:token entries, each token at least 16 characters"
            )
        return cls(settings.console_viewer_tokens, settings.console_operator_tokens)

    def user(self, token: str) -> User | None:
        """The user ``token`` logs in as, or None when it is no console token. Both lists are
        always compared, so the time does not tell which one matched."""
        bearer = f"Bearer {token.strip()}"
        operator = self._operators.client(bearer) if self._operators else None
        viewer = self._viewers.client(bearer) if self._viewers else None
        if operator is not None:
            return User(operator, Role.OPERATOR)
        if viewer is not None:
            return User(viewer, Role.VIEWER)
        return None
