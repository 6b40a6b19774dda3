"""Bytes to JSON and back, and the fingerprint that tells a redelivery from a reused key.

The fingerprint is SHA-256 over a canonical form (sorted keys, no insignificant whitespace,
UTF-8), so the same payload always yields the same fingerprint whatever its key order or spacing.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from pydantic_core import to_json, to_jsonable_python

from worker.errors import BodyTooDeep, BodyTooLarge, UndecodableBody

JSON_CONTENT_TYPE = "application/json"

DEFAULT_MAX_DEPTH = 64
"""How deeply a body may nest JSON arrays and objects (``max_json_depth``'s default): deep enough
for any business document, far below the depth where Python's JSON encoder and pydantic recurse
out of stack."""

DEFAULT_MAX_ITEMS = 10_000
"""How many members and elements a body's objects and arrays may hold in all
(``max_json_items``' default): the cost of decoding and fingerprinting a body grows with them
(80,000 names in 870 KB take a few hundred milliseconds of one core), not with its bytes."""

_BRACKET = re.compile(rb"[\[\]{}]")


def is_json_content_type(content_type: str | None) -> bool:
    """True for a missing content type, ``application/json`` and any ``+json`` type."""
    if not content_type:
        return True
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == JSON_CONTENT_TYPE or media_type.endswith("+json")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
"""Strict JSON: no ``NaN``/``Infinity``, no number out of a float's range; built once (each
``json.loads`` call with options builds a decoder of its own)."""

_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
"""The canonical encoder (``canonical_json``); built once, like ``_DECODER``."""

_NON_FINITE = (b"NaN", b"Infinity")


def nesting_depth_exceeds(body: bytes, limit: int) -> bool:
    """True when ``body`` opens more than ``limit`` nested arrays and objects, counting brackets
    outside JSON strings (a string left open runs to the end); linear in the body's size, and
    decides before anything is parsed.

    A body with at most ``limit`` opening brackets in all is decided without scanning it.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    return _deeper(outside_strings(body), limit)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one running to the end of the body."""

_CHUNK = 64 * 1024
"""Bytes one C call of ``outside_strings`` takes at a time, so that the thread that checks a
large body lets the event loop run between them (a call holds the GIL)."""


def outside_strings(body: bytes) -> bytes:
    """``body`` without its JSON strings (one left open runs to the end), as a scan from the
    start sees them: outside a string every byte stands for itself, inside one a backslash
    escapes the next byte. Without a backslash every quote opens or closes a string, so the body
    is split at its quotes a chunk at a time; with one, each string is matched in turn. No call
    holds the GIL for longer than a chunk or a string takes."""
    if b"\\" not in body:
        kept: list[bytes] = []
        inside = False
        for start in range(0, len(body), _CHUNK):
            pieces = body[start : start + _CHUNK].split(b'"')
            kept.extend(pieces[1 if inside else 0 :: 2])
            inside ^= len(pieces) % 2 == 0  # an odd number of quotes in the chunk
        return b"".join(kept)
    parts: list[bytes] = []
    end = 0
    for string in _JSON_STRING.finditer(body):
        parts.append(body[end : string.start()])
        end = string.end()
    parts.append(body[end:])
    return b"".join(parts)


def _deeper(outside_strings: bytes, limit: int) -> bool:
    depth = 0
    for bracket in _BRACKET.finditer(outside_strings):
        if bracket.group() in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _items(text: bytes) -> int:
    """Members and elements in ``text`` (the body outside its strings) at most: each but the
    first of an array or object follows a comma, the first its opening bracket."""
    return text.count(b",") + text.count(b"[") + text.count(b"{")


def check_shape(body: bytes, *, max_depth: int, max_items: int) -> None:
    """Refuse, before anything is parsed, a body nesting arrays and objects deeper than
    ``max_depth`` (``BodyTooDeep``) or holding more than ``max_items`` members and elements in
    all (``BodyTooLarge``; counted outside strings by ``_items``, so an empty array counts
    one). Linear in the body's size; a body whose bytes hold few enough brackets and commas
    anywhere is decided without scanning it."""
    opened = body.count(b"[") + body.count(b"{")
    if opened <= max_depth and _items(body) <= max_items:
        return
    outside = outside_strings(body)
    if opened > max_depth and _deeper(outside, max_depth):
        raise BodyTooDeep(f"body nests arrays and objects deeper than {max_depth} levels")
    if (items := _items(outside)) > max_items:
        raise BodyTooLarge(
            f"body holds {items} members and elements; the limit is {max_items} (max_json_items)"
        )


def decode_json(
    body: bytes,
    content_type: str | None = None,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> Any:
    """The JSON value in ``body``; raises ``UndecodableBody`` saying why it is not one."""
    return decode_canonical(body, content_type, max_depth=max_depth, max_items=max_items)[0]


def decode_fingerprinted(
    body: bytes,
    content_type: str | None = None,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> tuple[Any, bytes]:
    """The JSON value in ``body`` and its ``fingerprint``, from one canonical encoding (see
    ``decode_canonical``)."""
    value, canonical = decode_canonical(
        body, content_type, max_depth=max_depth, max_items=max_items
    )
    return value, canonical_fingerprint(canonical)


def decode_canonical(
    body: bytes,
    content_type: str | None = None,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> tuple[Any, bytes]:
    """The JSON value in ``body`` and its ``canonical_json``, each made once; raises
    ``UndecodableBody`` saying why it is not JSON, ``BodyTooDeep`` or ``BodyTooLarge`` (before
    parsing) when it nests deeper than ``max_depth`` or holds more than ``max_items`` members
    and elements (``check_shape``)."""
    if not is_json_content_type(content_type):
        raise UndecodableBody(f"unsupported content type {content_type!r}; expected JSON")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UndecodableBody(f"body is not UTF-8: {exc}") from exc
    check_shape(body, max_depth=max_depth, max_items=max_items)
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise UndecodableBody(f"body is not JSON: {exc}") from exc
    try:
        return value, canonical_json(value)
    except UnicodeEncodeError as exc:
        # an escaped lone surrogate ("\ud800") is valid JSON syntax but not a character
        raise UndecodableBody(f"body is not JSON text: {exc.reason} in a string") from exc


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def storable(text: str, limit: int | None = None) -> str:
    """``text`` made safe for a PostgreSQL TEXT column and an AMQP header: NUL and control
    characters (other than newline and tab) and lone surrogates escaped as ``\\xNN`` /
    ``\\udNNN``, then cut to ``limit`` characters."""
    escaped = _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
    escaped = escaped.encode("utf-8", "backslashreplace").decode("utf-8")
    return escaped if limit is None else escaped[:limit]


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON types; pydantic models, dataclasses, UUIDs and dates included."""
    return to_jsonable_python(value)


def canonical_json(value: Any) -> bytes:
    """The canonical encoding of a JSON value: sorted keys, compact separators, UTF-8."""
    return _CANONICAL.encode(value).encode("utf-8")


def fingerprint(value: Any) -> bytes:
    """SHA-256 digest of ``value``'s canonical JSON encoding."""
    return canonical_fingerprint(canonical_json(value))


def canonical_fingerprint(canonical: bytes) -> bytes:
    """The ``fingerprint`` of the value whose ``canonical_json`` is ``canonical``."""
    return hashlib.sha256(canonical).digest()


def encode_json(value: Any) -> bytes:
    """``value`` (any JSON-able object, pydantic models included) as compact UTF-8 JSON;
    ``ValueError`` for a float that is not finite, which JSON cannot hold.

    pydantic-core writes it (a tenth of the standard library's time); it spells a non-finite
    float ``NaN``/``Infinity``, so an encoding that holds either word anywhere is made again
    by the standard library, which refuses the float or, when the word was inside a string,
    gives the same JSON."""
    encoded = to_json(value, inf_nan_mode="constants")
    if any(word in encoded for word in _NON_FINITE):
        return json.dumps(
            to_jsonable(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    return encoded
