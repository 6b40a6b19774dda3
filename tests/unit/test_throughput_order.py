"""Scenario (e) of ``benchmarks.throughput`` notices an account whose events came out of order."""

from __future__ import annotations

import json

from benchmarks.throughput import out_of_order, settled_body

SENDS = [
    {"payment_id": "p1", "account": "a", "amount_cents": 1},
    {"payment_id": "p2", "account": "b", "amount_cents": 2},
    {"payment_id": "p3", "account": "a", "amount_cents": 3},
    {"payment_id": "p1", "account": "a", "amount_cents": 1},  # a repeat of p1
]


def bodies(order: list[int]) -> list[bytes]:
    return [settled_body(SENDS[i]) for i in order]


def test_accounts_in_commit_order_count_nothing_whatever_the_interleaving() -> None:
    assert out_of_order(SENDS, bodies([1, 0, 2, 3])) == 0
    assert json.loads(bodies([1])[0])["account"] == "b"


def test_a_swapped_pair_or_a_missing_event_counts_its_account() -> None:
    assert out_of_order(SENDS, bodies([2, 0, 1, 3])) == 1
    assert out_of_order(SENDS, bodies([0, 2, 3])) == 1
