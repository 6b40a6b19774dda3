"""``python -m benchmarks.throughput`` runs end to end against the services; timings unchecked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
RATIOS = ("c/a", "c/b", "p1/c", "p10/c", "plain/b", "d/a", "e/bare", "c+/c", "c/c-sa", "n2/n1")


def test_throughput_quick_run_prints_every_ratio() -> None:
    base = Settings.load()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(WORKER_DATABASE_URL=base.database_url, WORKER_AMQP_URL=base.amqp_url)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.throughput", "--quick", "--messages", "300"),
            *("--inbox-rows", "1000"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=170,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for ratio in RATIOS:
        assert any(line.startswith(ratio) and "x" in line for line in lines), result.stdout
    assert any(line.startswith("(c) worker") for line in lines), result.stdout
    assert any(line.startswith("(c+) worker") for line in lines), result.stdout
    assert "peak RSS after (c)" in result.stdout
    assert "publish -> commit" in result.stdout
