"""The ingress's edge decisions that need no server: which ``Host`` passes the check, and the
connection cap a process may keep under its limit of open files."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from worker.ingress.edge import host_allowed
from worker.ingress.reading import within_limit

ALLOWED = frozenset({"localhost", "127.0.0.1", "[::1]"})


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        (b"localhost", True),
        (b"localhost:8000", True),
        (b"LOCALHOST:8000", True),
        (b"127.0.0.1:80", True),
        (b"[::1]:8000", True),
        (b"[::1]", True),
        (b"evil.example", False),
        (b"evil.example:8000", False),
        (b"localhost.evil.example", False),
        (b"127.0.0.1.nip.io:8000", False),
        (b"[::2]:8000", False),
        (b"", False),
        (None, False),
    ],
)
def test_the_host_check_compares_the_name_without_its_port(
    host: bytes | None, allowed: bool
) -> None:
    headers = [] if host is None else [(b"host", host)]
    assert host_allowed({"headers": headers}, ALLOWED) is allowed


CAP_UNDER_A_LIMIT = """
import logging, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (600, 600))
from worker.ingress.serve import open_files_allow
print(open_files_allow(100), open_files_allow(512))
"""


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 600, reason="the hard limit is below 600"
)
def test_the_connection_cap_is_lowered_under_a_low_limit_of_open_files() -> None:
    # Given a process that may open 600 files at most
    result = subprocess.run(
        [sys.executable, "-c", CAP_UNDER_A_LIMIT], capture_output=True, text=True, check=True
    )
    # Then 100 connections fit (with their overflow, the backlog and the spare files), 512 do
    # not: the cap is lowered with a warning that names the setting
    *warnings, caps = result.stdout.splitlines()
    assert caps == "100 305"
    assert warnings == [
        "ingress_max_connections is 512, but the process may open 600 files: serving 305 "
        "connections at most (raise `ulimit -n`)"
    ]


@pytest.mark.parametrize(
    ("content_length", "within"),
    [
        (b"0", True),
        (b"1000", True),
        (b"0001000", True),
        (b"1001", False),
        (b"9" * 5000, False),
        (b"-1", False),
        (b"1e3", False),
        (b"", False),
    ],
)
def test_a_declared_length_is_within_the_limit_only_as_digits_of_at_most_it(
    content_length: bytes, within: bool
) -> None:
    assert within_limit(content_length, 1000) is within
