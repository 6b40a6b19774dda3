"""Bearer-token authentication of the ingress (``ingress_tokens``), off when no token is set.

Invariant: the time a check takes does not depend on how much of a token a client guessed. The
token sent and every accepted token are compared as SHA-256 digests (equal lengths, so
``hmac.compare_digest`` runs in constant time whatever was sent), and every accepted token is
compared, so the time does not tell which one matched either.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request

from worker.ingress.problems import unauthorized


class Tokens:
    """The accepted bearer tokens; ``check`` raises a 401 ``Problem`` for a request without one."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._digests = [_digest(token.encode("utf-8")) for token in tokens]

    @property
    def required(self) -> bool:
        """Whether a request must carry an accepted token (some are configured)."""
        return bool(self._digests)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries an accepted bearer token (always,
        when none is configured)."""
        if not self._digests:
            return True
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        # (Starlette decodes header values as Latin-1: these are the bytes the client sent)
        given = _digest(credentials.strip().encode("latin-1", "replace"))
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(given, digest)
        return matched and scheme.lower() == "bearer"

    def check(self, request: Request) -> None:
        """Raise the 401 ``Problem`` unless ``request`` carries an accepted token."""
        if not self.accepts(request.headers.get("authorization")):
            raise unauthorized()


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
