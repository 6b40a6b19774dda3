"""A throw-away PostgreSQL cluster that speaks TLS only, for testing the worker's TLS options.

``tls_cluster()`` makes a certificate authority and a server certificate for ``localhost`` and
``127.0.0.1`` with ``openssl``, a second, unrelated authority (the "wrong CA"), a new cluster
with ``initdb`` in a temporary directory, listening on a free port of 127.0.0.1 with ``ssl=on``
and a ``pg_hba.conf`` that admits TCP clients over TLS only (``hostssl``, SCRAM passwords). It
starts the cluster, creates the login role ``worker_tls`` and its database, and on exit stops
the cluster and removes every file: nothing outlives the ``with`` block. Run as root, the
cluster runs as the ``postgres`` system user (PostgreSQL refuses to run as root).

Run it by hand to try a client against it: ``python -m tests.integration.pg_tls`` prints the
URLs and keeps the cluster up until Enter is pressed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

USER = "worker_tls"
PASSWORD = "tls-secret"
SERVICE_USER = "postgres"
"""The system user the cluster runs as when the tests run as root."""


@dataclass(frozen=True)
class Certificates:
    """A CA, a server certificate it signed for ``localhost`` and 127.0.0.1, and another CA."""

    ca_file: Path
    wrong_ca_file: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class TlsCluster:
    """Where the cluster listens, and the certificates it serves and trusts."""

    port: int
    certificates: Certificates

    def url(self, query: str = "", *, password: str = PASSWORD, host: str = "localhost") -> str:
        """A libpq-style URL of the ``worker_tls`` database, as its owner, with ``query``."""
        url = f"postgresql://{USER}:{password}@{host}:{self.port}/{USER}"
        return f"{url}?{query}" if query else url


def bindir() -> Path | None:
    """The newest installed PostgreSQL's binaries (Debian's layout), or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4])
    )
    return Path(found[-1]).parent if found else None


@contextlib.contextmanager
def certificates() -> Iterator[Certificates]:
    """Fresh certificates in a temporary directory, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="worker-certs-") as tmp:
        yield make_certificates(Path(tmp))


@contextlib.contextmanager
def tls_cluster() -> Iterator[TlsCluster]:
    """A TLS-only cluster on a free port, stopped and removed on exit."""
    binaries = bindir()
    assert binaries is not None, "no PostgreSQL server binaries under /usr/lib/postgresql"
    with tempfile.TemporaryDirectory(prefix="worker-pg-tls-") as tmp:
        root = Path(tmp)
        certs = make_certificates(root / "certs")
        data = root / "data"
        port = _free_port()
        _give_to_service_user(root)
        _run(binaries / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        _configure(data, root, certs, port)
        _run(binaries / "pg_ctl", "-D", data, "-l", root / "server.log", "-w", "start")
        try:
            _run(
                binaries / "psql", "-h", root, "-p", str(port), "-U", "postgres", "-q",
                "-c", f"CREATE ROLE {USER} LOGIN CREATEDB PASSWORD '{PASSWORD}'",
                "-c", f"CREATE DATABASE {USER} OWNER {USER}",
            )  # fmt: skip
            yield TlsCluster(port, certs)
        finally:
            _run(binaries / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")


def make_certificates(directory: Path) -> Certificates:
    """``ca.crt`` and the server's ``server.crt``/``server.key`` signed by it, and an unrelated
    ``wrong-ca.crt``, in ``directory``; every certificate valid for a day."""
    directory.mkdir(exist_ok=True)
    for ca in ("ca", "wrong-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", f"/CN=worker test {ca}",
            "-keyout", directory / f"{ca}.key", "-out", directory / f"{ca}.crt",
        )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", directory / "server.key", "-out", directory / "server.csr",
    )  # fmt: skip
    (directory / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl(
        "x509", "-req", "-in", directory / "server.csr", "-days", "1",
        "-CA", directory / "ca.crt", "-CAkey", directory / "ca.key", "-CAcreateserial",
        "-extfile", directory / "server.ext", "-out", directory / "server.crt",
    )  # fmt: skip
    (directory / "server.key").chmod(0o600)
    return Certificates(
        ca_file=directory / "ca.crt",
        wrong_ca_file=directory / "wrong-ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
    )


def _configure(data: Path, root: Path, certs: Certificates, port: int) -> None:
    """TLS on, TCP on 127.0.0.1 only, and TCP clients admitted over TLS with a password only."""
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"port = {port}\n"
            "listen_addresses = '127.0.0.1'\n"
            f"unix_socket_directories = '{root}'\n"
            "ssl = on\n"
            f"ssl_cert_file = '{certs.server_cert}'\n"
            f"ssl_key_file = '{certs.server_key}'\n"
            "fsync = off\n"
            "shared_buffers = 16MB\n"
            "max_connections = 20\n"
        )
    (data / "pg_hba.conf").write_text(
        "local all postgres trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n"
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _give_to_service_user(root: Path) -> None:
    """As root, hand the directory to the user the cluster runs as (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return
    for path in (root, *root.rglob("*")):
        shutil.chown(path, SERVICE_USER, SERVICE_USER)


def _run(*command: str | Path) -> None:
    """Run a PostgreSQL program, as the service user when we are root; raise with its output."""
    argv = [str(part) for part in command]
    if os.geteuid() == 0:
        argv = ["runuser", "-u", SERVICE_USER, "--", *argv]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stdout}{result.stderr}")


def _openssl(*arguments: str | Path) -> None:
    subprocess.run(["openssl", *map(str, arguments)], capture_output=True, timeout=60, check=True)


if __name__ == "__main__":
    with tls_cluster() as cluster:
        print(cluster.url(f"sslmode=verify-full&sslrootcert={cluster.certificates.ca_file}"))
        print(f"wrong CA: {cluster.certificates.wrong_ca_file}")
        input("press Enter to stop the cluster ")
