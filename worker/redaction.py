"""The one place that hides secrets from what the worker prints: every log record, every line a
command shows, every error and the settings' echo go through ``redact``.

What it hides, wherever it appears in a text: the password of any URL's userinfo
(``scheme://user:password@host``, a password holding ``@`` included), the value of any
secret-looking parameter (``password=``, ``sslpassword=``, ``passwd=``, ``secret=``, ``token=``,
``api_key=``... in a URL's query or a libpq keyword string), and every value registered with
``remember`` (the ingress's bearer tokens, which have no shape to recognise). Each becomes
``***``; the rest of the text (scheme, user, host, the other parameters) stays readable.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

MASK = "***"

_PASSWORD_IN_URL = re.compile(r"(?P<prefix>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^\s/]*@")
"""A URL's userinfo password: up to the LAST ``@`` before the path or a blank, so that a
password holding ``@`` is hidden whole (a text run on after it is hidden too, never shown)."""

_SECRET_PARAMETER = re.compile(
    r"(?<![A-Za-z0-9_])(?P<name>[A-Za-z_]*(?:password|passwd|pwd|secrets?|tokens?|api_?key))"
    r"(?P<sep>=|%3D)(?:'[^']*'|\"[^\"]*\"|[^&\s'\"#]*)",
    re.IGNORECASE,
)
"""A secret-looking parameter and its value, in a URL query (``?password=``, ``&sslpassword=``)
or a keyword string (``password=... host=...``)."""

REMEMBERED_LENGTH = 8
"""The shortest value ``remember`` hides (the ingress's tokens have at least 16 characters)."""

_remembered: tuple[str, ...] = ()
_lock = threading.Lock()


def remember(secrets: Iterable[str]) -> None:
    """Hide these values too, wherever they appear from now on (values shorter than
    ``REMEMBERED_LENGTH`` characters are ignored: they would hide ordinary words)."""
    global _remembered
    with _lock:
        known = set(_remembered) | {value for value in secrets if len(value) >= REMEMBERED_LENGTH}
        # Longest first, so that a secret containing another is hidden whole.
        _remembered = tuple(sorted(known, key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every URL password, secret-looking parameter and remembered secret
    replaced by ``***``."""
    text = _PASSWORD_IN_URL.sub(rf"\g<prefix>{MASK}@", text)
    text = _SECRET_PARAMETER.sub(rf"\g<name>\g<sep>{MASK}", text)
    for secret in _remembered:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
