"""The container setup: docker-compose.yml and the Dockerfile run commands the CLI really has."""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from worker.ops.cli import build_parser
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
REQUIRED_ENV = ("WORKER_DATABASE_URL", "WORKER_AMQP_URL", "WORKER_HANDLERS")


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yml must be a mapping"
    return data


def services() -> dict[str, Any]:
    found = load_compose().get("services")
    assert isinstance(found, dict), "docker-compose.yml has no services"
    return found


def built_services() -> dict[str, dict[str, Any]]:
    """The services built from the project's own Dockerfile (``build: .``)."""
    built = {}
    for name, service in services().items():
        build = service.get("build")
        context = build.get("context") if isinstance(build, dict) else build
        if context in (".", "./"):
            built[name] = service
    return built


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    if isinstance(command, str):
        return shlex.split(command)
    assert isinstance(command, list), f"no command: {service!r}"
    return [str(part) for part in command]


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): str(value) for key, value in env.items()}


def cli_commands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("the worker CLI has no subcommands")


def test_the_one_shot_and_long_running_services_are_built_from_the_project() -> None:
    assert {"migrate", "worker", "relay", "demo"} <= set(built_services())


def test_every_built_service_runs_a_command_the_worker_cli_accepts() -> None:
    commands = cli_commands()
    for name, service in built_services().items():
        program, *arguments = command_of(service)

        assert program == "worker", name
        assert arguments, f"{name} names no subcommand"
        assert arguments[0] in commands, name
        # parse_args raises SystemExit on an unknown subcommand or flag, failing the test.
        args = build_parser().parse_args(arguments)
        assert args.command == arguments[0], name


def test_the_worker_is_configured_through_its_environment_variables() -> None:
    env = environment_of(services()["worker"])

    assert set(REQUIRED_ENV) <= set(env)
    assert env["WORKER_DATABASE_URL"].startswith("postgresql://")
    assert env["WORKER_AMQP_URL"].startswith("amqp://")
    modules = [module.strip() for module in env["WORKER_HANDLERS"].split(",") if module.strip()]
    assert modules, "WORKER_HANDLERS names no module"
    for module in modules:
        importlib.import_module(module)


@pytest.mark.parametrize("name", ["worker", "relay"])
def test_the_long_running_services_serve_health_and_metrics_on_every_interface(
    name: str,
) -> None:
    """The container's endpoint must be reachable from its network; ``worker health`` inside
    it asks the loopback address for the wildcard."""
    assert environment_of(services()[name])["WORKER_HTTP_HOST"] == "0.0.0.0"
    assert services()[name]["healthcheck"]["test"] == ["CMD", "worker", "health"]


def test_the_built_services_share_one_configuration() -> None:
    environments = [environment_of(service) for service in built_services().values()]
    assert all(env == environments[0] for env in environments)


@pytest.mark.parametrize("name", ["postgres", "rabbitmq"])
def test_the_backing_services_have_healthchecks(name: str) -> None:
    healthcheck = services()[name].get("healthcheck")
    assert isinstance(healthcheck, dict)
    assert healthcheck.get("test"), f"{name} has an empty healthcheck"


@pytest.mark.parametrize("name", ["worker", "relay"])
def test_the_long_running_services_start_after_the_migrations_and_a_healthy_broker(
    name: str,
) -> None:
    depends_on = services()[name]["depends_on"]

    assert depends_on["migrate"]["condition"] == "service_completed_successfully"
    assert depends_on["rabbitmq"]["condition"] == "service_healthy"
    assert services()["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose is not installed (CI installs it to validate the compose file)",
)
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker-compose", "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_image_runs_the_worker_command() -> None:
    instructions = [
        line.strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.strip().upper().startswith(("CMD", "ENTRYPOINT"))
    ]
    assert instructions, "the Dockerfile has no CMD or ENTRYPOINT"

    _, _, argument = instructions[-1].partition(" ")
    words = yaml.safe_load(argument) if argument.lstrip().startswith("[") else argument.split()

    assert words[0] == "worker"


def test_the_image_does_not_run_as_root() -> None:
    users = [
        line.split()[1]
        for line in DOCKERFILE.read_text().splitlines()
        if line.strip().upper().startswith("USER ")
    ]
    assert users, "the Dockerfile never switches to a non-root user"
    assert users[-1] not in ("root", "0")


def mounted(service: dict[str, Any]) -> dict[str, str]:
    """The service's bind mounts: container path -> host path relative to the project."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = str(volume).split(":")
        found[target] = source
    return found


def broker_config() -> dict[str, str]:
    """``deploy/rabbitmq/rabbitmq.conf`` as key -> value, comments left out."""
    lines = (ROOT / "deploy" / "rabbitmq" / "rabbitmq.conf").read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def test_the_broker_loads_the_projects_users_and_limits() -> None:
    mounts = mounted(services()["rabbitmq"])

    for source in mounts.values():
        assert (ROOT / source).is_file(), source
    config_mount = next(t for t, s in mounts.items() if s.endswith("rabbitmq.conf"))
    assert config_mount.startswith("/etc/rabbitmq/conf.d/")  # beside the image's defaults
    definitions = broker_config()["load_definitions"]
    assert mounts[definitions] == "./deploy/rabbitmq/definitions.json"


def test_the_broker_refuses_bodies_the_worker_would_refuse_with_room_for_headers() -> None:
    limit = int(broker_config()["max_message_size"])
    max_body = Settings().max_body_bytes

    assert max_body < limit <= max_body + 64 * 1024


def test_the_worker_connects_as_its_least_privilege_user() -> None:
    url = urlsplit(environment_of(services()["worker"])["WORKER_AMQP_URL"])
    definitions = json.loads((ROOT / "deploy" / "rabbitmq" / "definitions.json").read_text())

    assert url.username == "worker"
    assert "worker" in {user["name"] for user in definitions["users"]}
    assert "guest" not in {user["name"] for user in definitions["users"]}


def test_the_ingress_listens_in_its_container_and_is_published_on_the_loopback_only() -> None:
    ingress = services()["ingress"]
    args = build_parser().parse_args(command_of(ingress)[1:])
    assert args.command == "serve"
    assert args.ingress_host == "0.0.0.0"
    assert ingress["ports"] == ["127.0.0.1:8000:8000"]
    assert Settings().ingress_port == 8000
    assert ingress["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
