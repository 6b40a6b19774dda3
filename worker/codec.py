"""Bytes to JSON and back, and the fingerprint that tells a redelivery from a reused key.

The fingerprint is SHA-256 over a canonical form (sorted keys, no insignificant whitespace,
UTF-8), so the same payload always yields the same fingerprint whatever its key order or spacing.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pydantic_core import to_jsonable_python

from worker.errors import UndecodableBody

JSON_CONTENT_TYPE = "application/json"


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


def decode_json(body: bytes, content_type: str | None = None) -> Any:
    """The JSON value in ``body``; raises ``UndecodableBody`` saying why it is not one."""
    return decode_fingerprinted(body, content_type)[0]


def decode_fingerprinted(body: bytes, content_type: str | None = None) -> tuple[Any, bytes]:
    """The JSON value in ``body`` and its ``fingerprint``, from one canonical encoding; raises
    ``UndecodableBody`` saying why it is not JSON."""
    if not is_json_content_type(content_type):
        raise UndecodableBody(f"unsupported content type {content_type!r}; expected JSON")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UndecodableBody(f"body is not UTF-8: {exc}") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise UndecodableBody(f"body is not JSON: {exc}") from exc
    try:
        return value, fingerprint(value)
    except UnicodeEncodeError as exc:
        # an escaped lone surrogate ("\ud800") is valid JSON syntax but not a character
        raise UndecodableBody(f"body is not JSON text: {exc.reason} in a string") from exc


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON types; pydantic models, dataclasses, UUIDs and dates included."""
    return to_jsonable_python(value)


def canonical_json(value: Any) -> bytes:
    """The canonical encoding of a JSON value: sorted keys, compact separators, UTF-8."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def fingerprint(value: Any) -> bytes:
    """SHA-256 digest of ``value``'s canonical JSON encoding."""
    return hashlib.sha256(canonical_json(value)).digest()


def encode_json(value: Any) -> bytes:
    """``value`` (any JSON-able object, pydantic models included) as compact UTF-8 JSON."""
    return json.dumps(
        to_jsonable(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")
