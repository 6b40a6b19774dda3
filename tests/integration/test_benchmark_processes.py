"""``python -m benchmarks.processes`` runs end to end against the services; timings unchecked."""

from __future__ import annotations

from tests.integration.support import run_benchmark


def test_processes_benchmark_drains_with_1_and_2_processes_and_prints_the_ratio() -> None:
    result = run_benchmark("processes", "--messages", "300")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"], result.stdout
    assert "median msg/s: N=1 " in result.stdout
    assert any(line.startswith("ratio N=2/N=1: ") for line in lines), result.stdout
