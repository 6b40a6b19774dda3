"""``python -m benchmarks.footprint`` runs end to end against the services; figures unchecked."""

from __future__ import annotations

from tests.integration.support import run_benchmark


def test_footprint_benchmark_measures_each_process_and_prints_a_line_for_each() -> None:
    result = run_benchmark(
        "footprint", "--messages", "300", "--requests", "60", "--big", "20", "--stall", "1"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert set(rows) == {"run", "relay", "serve", "big"}, result.stdout
    for scenario, row in rows.items():
        # items, seconds, rate, then the peak resident set read from /proc, in MiB
        assert row[5] == "MiB", row
        assert float(row[4]) > 0, scenario
