"""``python -m benchmarks.processes`` runs end to end against the services; timings unchecked."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.support import ROOT
from worker.settings import Settings


def test_processes_benchmark_drains_with_1_and_2_processes_and_prints_the_ratio() -> None:
    base = Settings.load()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(WORKER_DATABASE_URL=base.database_url, WORKER_AMQP_URL=base.amqp_url)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.processes", "--messages", "300"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"], result.stdout
    assert "median msg/s: N=1 " in result.stdout
    assert any(line.startswith("ratio N=2/N=1: ") for line in lines), result.stdout
