"""``python -m benchmarks.dlq_sweep`` runs end to end against the services, on a classic and a
quorum DLQ; timings unchecked."""

from __future__ import annotations

import pytest

from tests.integration.support import run_benchmark


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_short_run_sweeps_every_copy_and_prints_its_figures(queue_type: str) -> None:
    # When the benchmark runs over 30 parked copies, in chunks of 7
    result = run_benchmark(
        "dlq_sweep", "--copies", "30", "--runs", "1", "--chunk", "7", "--queue-type", queue_type
    )

    # Then each view went over all 30, and the listing's peak memory is printed
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for view in ("groups", "preview"):
        assert any(line.split()[:5] == [view, "run", "1:", "30", "messages"] for line in lines)
    assert any(line.startswith("worker dlq list --all: peak RSS") for line in lines), lines
