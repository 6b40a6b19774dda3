# The worker image: `worker run` by default; compose also uses it for `worker migrate`,
# `worker serve` and `worker demo`.
# Pinned by tag: to pin by digest, resolve it where a registry is reachable
# (`docker buildx imagetools inspect python:3.11-slim`) and write FROM python:3.11-slim@sha256:...
# (docs/operations.md, "Docker").
FROM python:3.11-slim

# A container's network namespace is its own: /healthz and /metrics listen on every interface of
# it, so probes and scrapers reach them (a host install defaults to 127.0.0.1).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    WORKER_HTTP_HOST=0.0.0.0

WORKDIR /app

# The dependencies exactly as locked, hash-checked (a layer of their own: rebuilt only when
# the lock changes), then the worker itself without resolving anything again. The lock holds the
# `http` extra (FastAPI, uvicorn), so the same image runs `worker serve`, the HTTP ingress.
COPY requirements.lock .
RUN pip install --no-cache-dir --require-hashes -r requirements.lock

# .dockerignore keeps the virtualenv, git metadata, caches and tests out of the context.
# The worker (distribution rabbit-outbox-worker) is installed from a copy of the sources that is
# removed afterwards, so `import worker` always means the installed package.
WORKDIR /tmp/source
COPY . .
# The user has a fixed uid and gid (10001), which Kubernetes' runAsNonRoot can verify and
# deploy/kubernetes names in runAsUser.
RUN pip install --no-cache-dir --no-deps . \
    && rm -rf /tmp/source \
    && groupadd --system --gid 10001 worker \
    && useradd --system --uid 10001 --gid worker --no-create-home --shell /usr/sbin/nologin worker

# The example handler modules are not part of the package: they sit in /app, importable as
# WORKER_HANDLERS=examples.payments from any working directory.
WORKDIR /app
COPY examples ./examples
ENV PYTHONPATH=/app

# Numeric, so that a runtime can tell it is not root without reading /etc/passwd. Nothing is
# written below / at run time (no bytecode, logs to stdout): a read-only root filesystem works.
USER 10001:10001

CMD ["worker", "run"]
