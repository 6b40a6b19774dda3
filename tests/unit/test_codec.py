"""Bytes to JSON and back, and the canonical fingerprint; pure functions, no services."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from pydantic import BaseModel

from worker.core.codec import (
    canonical_json,
    check_shape,
    decode_fingerprinted,
    decode_json,
    encode_json,
    fingerprint,
    outside_strings,
)
from worker.errors import BodyTooDeep, BodyTooLarge, UndecodableBody


def test_decode_json_returns_the_value() -> None:
    body = '{"a": [1, 2.5, null, true], "b": {"c": "é"}}'.encode()
    assert decode_json(body) == {"a": [1, 2.5, None, True], "b": {"c": "é"}}


def test_decode_json_accepts_a_top_level_scalar_and_list() -> None:
    assert decode_json(b"[1, 2]") == [1, 2]
    assert decode_json(b'"text"') == "text"


def test_non_utf8_body_is_undecodable_and_says_utf8() -> None:
    with pytest.raises(UndecodableBody, match="UTF-8") as caught:
        decode_json(b'{"a": "\xff\xfe"}')
    assert caught.value.reason == "undecodable"


@pytest.mark.parametrize("body", [b"", b"{", b"{'a': 1}", b"[1, 2,]", b"nope"])
def test_invalid_json_is_undecodable(body: bytes) -> None:
    with pytest.raises(UndecodableBody, match="not JSON"):
        decode_json(body)


@pytest.mark.parametrize(
    "body", [b"NaN", b"Infinity", b"-Infinity", b'{"x": NaN}', b'{"x": [1, -Infinity]}']
)
def test_nan_and_infinity_are_rejected(body: bytes) -> None:
    with pytest.raises(UndecodableBody):
        decode_json(body)


def test_out_of_range_number_is_rejected_like_infinity() -> None:
    with pytest.raises(UndecodableBody):
        decode_json(b'{"x": 1e400}')


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", "application/jsonp"])
def test_non_json_content_type_is_rejected(content_type: str) -> None:
    with pytest.raises(UndecodableBody, match="content type"):
        decode_json(b"{}", content_type)


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "",
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.x+json",
    ],
)
def test_json_content_types_and_a_missing_one_are_accepted(content_type: str | None) -> None:
    assert decode_json(b'{"a": 1}', content_type) == {"a": 1}


def test_fingerprint_ignores_key_order_and_whitespace() -> None:
    a = decode_json(b'{"payment_id": "p1", "nested": {"x": 1, "y": [1, 2]}, "amount": 5}')
    b = decode_json(b'{"amount":5,\n  "nested":{"y":[1,2],"x":1},"payment_id":"p1"}')
    assert fingerprint(a) == fingerprint(b)


def test_fingerprint_changes_with_a_value() -> None:
    a = decode_json(b'{"payment_id": "p1", "amount": 5}')
    b = decode_json(b'{"payment_id": "p1", "amount": 6}')
    assert fingerprint(a) != fingerprint(b)


def test_fingerprint_is_a_sha256_digest_of_the_canonical_form() -> None:
    value = {"b": 1, "a": "x"}
    digest = fingerprint(value)
    assert isinstance(digest, bytes)
    assert len(digest) == 32
    assert digest == hashlib.sha256(b'{"a":"x","b":1}').digest()


def test_canonical_json_is_sorted_compact_utf8() -> None:
    value = {"b": [1, {"z": 1, "y": 2}], "a": "é"}
    assert canonical_json(value) == '{"a":"é","b":[1,{"y":2,"z":1}]}'.encode()


def test_canonical_json_refuses_nan() -> None:
    with pytest.raises(ValueError, match="JSON"):
        canonical_json({"x": float("nan")})


class Payment(BaseModel):
    payment_id: str
    amount_cents: int


def test_encode_json_handles_pydantic_models_and_uuids() -> None:
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    encoded = encode_json({"id": ident, "payment": Payment(payment_id="p1", amount_cents=5)})
    assert b" " not in encoded
    assert json.loads(encoded) == {
        "id": "12345678-1234-5678-1234-567812345678",
        "payment": {"payment_id": "p1", "amount_cents": 5},
    }


def test_encode_json_keeps_non_ascii_as_utf8() -> None:
    assert encode_json({"name": "Zoë"}) == '{"name":"Zoë"}'.encode()


@pytest.mark.parametrize("value", [float("nan"), {"x": [1.0, float("inf")]}, -float("inf")])
def test_encode_json_refuses_a_float_json_cannot_hold(value: object) -> None:
    with pytest.raises(ValueError, match="JSON"):
        encode_json(value)


@pytest.mark.parametrize(
    "value",
    [
        {"note": "NaN", "text": "Infinity and beyond", "amount": 1.5},
        ["NaN", -0.0, 10**30, "\x00\u2028", {"1": None}],
        {"deep": [{"x": [1e-7, 2.5e300]}]},
    ],
)
def test_encode_json_round_trips_words_in_strings_and_edge_numbers(value: object) -> None:
    assert json.loads(encode_json(value)) == value


def wide_object(names: int) -> bytes:
    return json.dumps({f"k{i:05d}": 1 for i in range(names)}).encode()


@pytest.mark.parametrize(
    ("body", "items"),
    [
        (b'{"a": 1, "b": [1, 2, 3]}', 5),  # a, b, and three elements: the count is exact
        (b"[[], {}]", 4),  # an empty array or object counts one
        (b'["a,b,c", "[{"]', 2),  # commas and brackets in strings are text, not items
    ],
)
def test_check_shape_counts_members_and_elements_outside_strings(body: bytes, items: int) -> None:
    check_shape(body, max_depth=64, max_items=items)
    with pytest.raises(BodyTooLarge, match=f"holds {items} members and elements"):
        check_shape(body, max_depth=64, max_items=items - 1)


def test_a_body_of_too_many_names_is_refused_before_it_is_parsed() -> None:
    body = wide_object(80_000)
    with pytest.raises(BodyTooLarge, match=r"the limit is 10000 \(max_json_items\)"):
        decode_fingerprinted(body)
    assert decode_json(body, max_items=80_000)["k79999"] == 1


def test_depth_is_decided_before_the_item_count() -> None:
    with pytest.raises(BodyTooDeep):
        check_shape(b"[" * 100 + b"]" * 100, max_depth=64, max_items=10)


def test_a_string_full_of_commas_is_one_item() -> None:
    body = json.dumps({"text": "," * 50_000}).encode()
    assert decode_json(body, max_items=1) == {"text": "," * 50_000}


@pytest.mark.parametrize(
    ("body", "outside"),
    [
        (rb'{"a": [1, "x"]}', rb"{: [1, ]}"),
        (rb'["q\"[", 1]', rb"[, 1]"),  # an escaped quote does not end the string
        (rb'["back\\", [2]]', rb"[, [2]]"),  # an escaped backslash does not escape the quote
        (rb'["\\\"{", 3]', rb"[, 3]"),
        (rb'[1, "open [[[', rb"[1, "),  # a string left open runs to the end
    ],
)
def test_outside_strings_drops_every_string_and_only_them(body: bytes, outside: bytes) -> None:
    assert outside_strings(body) == outside
