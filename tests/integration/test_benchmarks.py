"""The benchmarks (throughput, ingress, scheduled events, the console's cost) run end to end against
the services; timings unchecked."""

from __future__ import annotations

import pytest

from benchmarks import peer
from tests.integration.support import run_benchmark

RATIOS = (
    "c/a",
    "c/a-limit",
    "c/b",
    "p1/c",
    "p10/c",
    "j/c",
    "jc/c",
    "plain/b",
    "plain-pre/b",
    "plain-pg/b",
    "d/a",
    "e/bare",
    "c+/c",
    "c/c-sa",
    "n2/n1",
)


def test_throughput_quick_run_prints_every_ratio() -> None:
    result = run_benchmark("throughput", "--quick", "--messages", "300", "--inbox-rows", "1000")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for ratio in RATIOS:
        assert any(line.startswith(ratio) and "x" in line for line in lines), result.stdout
    assert any(line.startswith("(c) worker") for line in lines), result.stdout
    assert any(line.startswith("(c+) worker") for line in lines), result.stdout
    assert "peak RSS after (c)" in result.stdout
    assert "publish -> commit" in result.stdout


PEER_BUILD_SECONDS = 45.0
"""How long each step of building .venv-peer may take here; slower (a slow package index) skips."""


def test_throughput_runs_the_faststream_peer_as_d_does() -> None:
    # Given the peer's own virtualenv, built from the package index when missing
    try:
        peer.peer_python(timeout=PEER_BUILD_SECONDS)
    except peer.PeerUnavailable as exc:
        pytest.skip(f"the FastStream peer's virtualenv cannot be made here: {exc}")
    # When (d) and (f) run on the same payments
    result = run_benchmark("throughput", "--only", "d,f", "--messages", "200")
    # Then (f) finished with every payment, notice and event checked (no note), and d/f printed
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    [row] = [line for line in lines if line.startswith("(f) ")]
    assert row.split()[-3].replace(".", "").isdigit(), result.stdout
    assert any(line.startswith("d/f") and "x" in line for line in lines), result.stdout


def test_ingress_quick_run_prints_the_ratio_and_the_p99() -> None:
    result = run_benchmark("ingress", "--quick", "--requests", "200", "--seconds", "0.5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("ingress ") and "{202:" in line for line in lines), result.stdout
    assert any(line.startswith("baseline ") and "{202:" in line for line in lines), result.stdout
    assert any(line.startswith("ratio ingress/baseline ") for line in lines), result.stdout
    assert any(line.startswith("ingress p99 at 500 req/s ") for line in lines), result.stdout
    # and the attacks: every probe answered under each (200 idle connections, 40 slow bodies)
    for attack in ("idle flood", "slow bodies"):
        [line] = [line for line in lines if line.startswith(attack)]
        assert " 10/10 " in line, result.stdout


def test_scheduled_small_run_prints_every_ratio_and_publishes_none_early() -> None:
    # Given a small run: 10,000 future events, 2 s of due events, 500 rows per drain
    result = run_benchmark(
        "scheduled", "--future", "10000", "--seconds", "2", "--rows", "500", "--wakeups", "10"
    )
    # Then it finished with every drain, claim cost, wake-up and ratio printed
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for drain in ("(d0) ", "(d1) ", "(over) ", "(alt) "):
        assert any(line.startswith(drain) and "500" in line for line in lines), result.stdout
    for ratio in ("d1/d0", "w1/w0 p50", "w1/w0 p99", "over/d1", "alt/d0", "l1/l0 p99"):
        assert any(line.startswith(ratio) and "x" in line for line in lines), result.stdout
    for lateness in ("l0 p99", "l1 p99"):
        assert any(line.startswith(lateness) for line in lines), result.stdout
    # and in both lateness runs every scheduled event arrived, none before it was due by the
    # database's clock
    assert result.stdout.count("  early 0, missing 0, ") == 2, result.stdout


def test_console_quick_run_prints_each_arm_the_ratios_and_the_console_s_figures() -> None:
    # Given a smoke run: one round of A, B and C on 300 messages, the real `worker console` in
    # B and C with a client process that logs in and opens the overview
    result = run_benchmark("console", "--quick")
    # Then every arm drained, both ratios and the verdict on 2 % are printed
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for arm in ("(A) worker, no console", "(B) + console", "(C) + console"):
        assert any(line.startswith(f"1      {arm}") for line in lines), result.stdout
    for ratio in ("B/A", "C/A"):
        assert any(line.startswith(ratio) and "x" in line for line in lines), result.stdout
    assert any(line.startswith("under 2 %: ") for line in lines), result.stdout
    # and in B and C the overview page loaded (logged in, answered 200), with its latency lines,
    # the console's CPU and the reads behind a refresh
    for arm in ("B", "C"):
        [at] = [i for i, line in enumerate(lines) if line.startswith(f"console during ({arm})")]
        summary = lines[at + 1]
        assert "1 page loads, 0 not answered 200" in summary, result.stdout
    for line in ("GET /overview/live", "GET /overview/charts", "cpu, console process: "):
        assert result.stdout.count(f"  {line}") == 2, result.stdout
    assert "history(): the charts' read" in result.stdout
    assert "(n=100)" in result.stdout
