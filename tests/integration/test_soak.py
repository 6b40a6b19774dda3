"""``python -m benchmarks.soak`` and ``python -m benchmarks.retention`` run end to end against the
services; sizes, rates and timings unchecked."""

from __future__ import annotations

import csv
from pathlib import Path

from tests.integration.support import run_benchmark

PER_TABLE = ("total_bytes", "heap_bytes", "indexes_bytes", "n_live_tup", "n_dead_tup")
PER_TABLE_VACUUMS = ("vacuum_count", "autovacuum_count", "last_autovacuum", "autoanalyze_count")
INDEXES = (
    "pk_inbox",
    "ix_inbox_updated_at",
    "ix_inbox_in_progress",
    "pk_outbox",
    "uq_outbox_message_id",
    "ix_outbox_available_at_id",
)


def test_a_short_soak_prints_its_summary_and_writes_a_sample_per_interval(tmp_path: Path) -> None:
    samples = tmp_path / "soak.csv"
    result = run_benchmark(
        "soak", "--minutes", "0.3", "--rate", "50", "--sample", "5s", "--csv", str(samples)
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("  worker: inbox_retention 5m ") for line in lines), result.stdout
    for relation in ("inbox (total)", "inbox (heap)", "outbox (indexes)", "  pk_inbox"):
        assert any(line.startswith(relation) for line in lines), result.stdout
    assert any(line.startswith("rates over ") for line in lines), result.stdout

    with samples.open(newline="") as sink:
        rows = list(csv.DictReader(sink))
    columns = set(rows[0])
    expected = {
        "elapsed_s",
        "offered",
        "offered_per_s",
        "handled_per_s",
        "queue_depth",
        "outbox_backlog",
        *(f"{t}_{c}" for t in ("inbox", "outbox") for c in PER_TABLE + PER_TABLE_VACUUMS),
        *(f"{index}_bytes" for index in INDEXES),
    }
    assert expected <= columns, expected - columns
    # a sample at the start, every 5 s, and at the end (18 s)
    assert [float(row["elapsed_s"]) for row in rows] == [0.0, 5.0, 10.0, 15.0, 18.0]
    # the worker handled what was offered: the counts grow, the inbox holds keys
    assert int(rows[-1]["offered"]) > int(rows[1]["offered"]) > 0
    assert int(rows[-1]["requests_processed"]) > 0
    assert int(rows[-1]["inbox_n_tup_ins"]) > 0


def test_the_retention_benchmark_shows_a_time_partitioned_inbox_claiming_a_key_twice() -> None:
    result = run_benchmark("retention", "--rows", "2000")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for step in ("janitor sweep (batched DELETE)", "  VACUUM inbox after it", "DROP TABLE of a"):
        assert any(line.startswith(step) for line in lines), result.stdout
    # PostgreSQL refuses uniqueness of (handler, key) alone over the partitions ...
    assert "(handler, key): refused: unique constraint on partitioned table must include" in (
        result.stdout
    )
    # ... so a key found again within its partition is claimed again across a boundary
    claims = [line for line in lines if line.startswith(("  a key claimed", "  claimed again"))]
    assert [line.partition("DO NOTHING): ")[2] for line in claims] == [
        "accepted, 1 row(s) written; rows of the key: 1",
        "accepted, 0 row(s) written; rows of the key: 1",
        "accepted, 1 row(s) written; rows of the key: 2",
    ], result.stdout
