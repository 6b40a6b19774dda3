"""Bearer-token authentication of the ingress (``ingress_tokens``), off when no token is set, and
the client each request speaks for.

Invariant: the time a check takes does not depend on how much of a token a client guessed. The
token sent and every accepted token are compared as SHA-256 digests (equal lengths, so
``hmac.compare_digest`` runs in constant time whatever was sent), and every accepted token is
compared, so the time does not tell which one matched either. A request is answered as the
client its token names (``name:token``; a bare token is a client of its own), or as
``ANONYMOUS`` when no token is configured: what a client posts and reads is scoped to it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request

from worker.ingress.problems import unauthorized
from worker.settings import token_client

ANONYMOUS = "anonymous"
"""The client of every request when no token is configured (everyone is the same client)."""


class Tokens:
    """The accepted bearer tokens and their clients; ``check`` names the client of a request, or
    raises a 401 ``Problem`` for one without an accepted token."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._clients = [
            (_digest(token.encode("utf-8")), client) for client, token in map(token_client, tokens)
        ]

    @property
    def required(self) -> bool:
        """Whether a request must carry an accepted token (some are configured)."""
        return bool(self._clients)

    def client(self, authorization: str | None) -> str | None:
        """The client an ``Authorization`` header value's bearer token speaks for (``ANONYMOUS``
        when no token is configured); None when it carries no accepted token."""
        if not self._clients:
            return ANONYMOUS
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        # (Starlette decodes header values as Latin-1: these are the bytes the client sent)
        given = _digest(credentials.strip().encode("latin-1", "replace"))
        found: str | None = None
        for digest, client in self._clients:
            matched = hmac.compare_digest(given, digest)
            found = client if matched and found is None else found
        return found if scheme.lower() == "bearer" else None

    def check(self, request: Request) -> str:
        """The client ``request`` speaks for; the 401 ``Problem`` unless it carries an accepted
        token."""
        client = self.client(request.headers.get("authorization"))
        if client is None:
            raise unauthorized()
        return client


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
