"""The ingress answers as its OpenAPI document says, for cases schemathesis derives from that
document: a real ``worker serve`` process (the payments example, tokens on) against the real
PostgreSQL, driven by the schemathesis command over sockets. A bounded number of cases per
operation keeps it to seconds; ``SCHEMATHESIS_MAX_EXAMPLES`` raises it for a longer hunt."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.test_ingress import served_port, start_serve
from worker.settings import Settings

TOKEN = "schemathesis-token-0123456789"
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "30"))


async def test_the_ingress_conforms_to_its_openapi_document_and_never_answers_5xx(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    process = start_serve(settings, log, WORKER_INGRESS_TOKENS=f"fuzz:{TOKEN}")
    try:
        port = await served_port(log)
        run = await asyncio.to_thread(
            subprocess.run,
            [
                str(SCHEMATHESIS),
                "run",
                f"http://127.0.0.1:{port}/openapi.json",
                "--checks",
                "all",
                # (a valid body is refused when its key was used with another body, a 422 by
                # design; and JSON Schema's integer admits 2254.0, which a strict model refuses)
                "--exclude-checks",
                "positive_data_acceptance",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--seed",
                "26",
                "--workers",
                "1",
                "--phases",
                "examples,coverage,fuzzing",
                "--header",
                f"Authorization: Bearer {TOKEN}",
                "--request-timeout",
                "10",
                "--suppress-health-check",
                "too_slow",
            ],
            capture_output=True,
            text=True,
            timeout=150,
            cwd=tmp_path,
            env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
        )
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)

    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "No issues found" in output or "passed" in output, output
    assert "ERROR" not in log.read_text(), log.read_text()
