"""Reading what a client posted as the ``Delivery`` the consumer would get, so that the
consumer's own checks (``worker.core.envelope.open_envelope``) decide what the ingress accepts.

Invariant: every header and byte is hostile until checked, and a body is never read past
``max_body_bytes``: a declared Content-Length over it is refused before a byte is read, and a body
sent without one (chunked) as soon as it passes the limit. The Idempotency-Key is taken as the
bytes the client sent (decoded as UTF-8 by the consumer's key check, not as Latin-1 by the HTTP
layer), and a request carrying two of them is refused rather than one picked.
"""

from __future__ import annotations

from starlette.requests import Request

from worker.core.codec import is_json_content_type
from worker.core.envelope import IDEMPOTENCY_KEY_HEADER, Delivery, idempotency_key
from worker.errors import BodyTooLarge, InvalidKey, MissingKey
from worker.ingress.problems import unsupported_media_type

_KEY_HEADER = IDEMPOTENCY_KEY_HEADER.encode("latin-1")
_LONGEST_LENGTH = len(str(2**63))
"""Digits of a Content-Length that could still be a size (longer: too large in any case)."""


def key_header(request: Request) -> bytes | None:
    """The raw ``Idempotency-Key`` header, None without one; two of them are an ``InvalidKey``."""
    values = [value for name, value in request.scope["headers"] if name.lower() == _KEY_HEADER]
    if len(values) > 1:
        raise InvalidKey("the request carries more than one Idempotency-Key header")
    return values[0] if values else None


def client_key(request: Request, routing_key: str) -> str:
    """The request's Idempotency-Key, checked by the consumer's own key check: a ``MissingKey``
    or an ``InvalidKey`` (not UTF-8, too long, a NUL) when the consumer would refuse it too."""
    raw = key_header(request)
    if not raw:
        raise MissingKey("the request has no Idempotency-Key header (or an empty one)")
    return idempotency_key(Delivery(b"", routing_key, headers={IDEMPOTENCY_KEY_HEADER: raw}))


def json_content_type(request: Request) -> str:
    """The request's content type, which must be declared and JSON (``application/json`` or a
    ``+json`` type); a ``Problem`` (415) otherwise."""
    content_type = request.headers.get("content-type")
    if not content_type or not is_json_content_type(content_type):
        raise unsupported_media_type(content_type)
    return content_type


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes; ``BodyTooLarge`` as soon as it is known to
    be longer (from its Content-Length, before reading; else once the bytes read pass it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > _LONGEST_LENGTH or int(declared) > limit):
        raise BodyTooLarge(f"Content-Length is {declared[:40]} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body passed the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_delivery(request: Request, routing_key: str, *, max_body_bytes: int) -> Delivery:
    """The posted message as the consumer's ``Delivery``: its routing key, its Idempotency-Key
    header as sent, its declared JSON content type and its body, read within the limit. The
    key and the content type are checked before the body is read."""
    client_key(request, routing_key)
    content_type = json_content_type(request)
    body = await read_body(request, max_body_bytes)
    return Delivery(
        body,
        routing_key,
        headers={IDEMPOTENCY_KEY_HEADER: key_header(request) or b""},
        content_type=content_type,
    )
