"""deploy/kubernetes: every manifest is valid against the Kubernetes API's JSON schemas of a pinned
version (``kubernetes-validate`` ships them: no network, no cluster), and the facts no schema can
check hold: every ``WORKER_*`` name is a real setting, every command a real ``worker``
subcommand, the probes ask endpoints the processes serve on the ports they listen on, the
termination grace outlasts the shutdown grace, KEDA scales the worker Deployment on the
configured queue, and the selectors select the pods they mean.

KEDA's ScaledObject and TriggerAuthentication are custom resources: the index has no schema of
them to install (docs/kubernetes.md says what was considered), so they are checked here field
by field against KEDA's documented specification, and the HorizontalPodAutoscaler that KEDA makes
from the ScaledObject is validated against the Kubernetes schema.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from worker.ingress import serve as ingress_serve
from worker.ops.cli import build_parser
from worker.ops.health import Health
from worker.ops.http import HttpServer
from worker.ops.metrics import Metrics
from worker.settings import FIELDS, Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"
EXAMPLE_SECRET = DEPLOY / "secret.example.yaml"

KUBERNETES_VERSION = "1.31"
"""The oldest Kubernetes the manifests are for: the Job's podFailurePolicy and the
PodDisruptionBudgets' unhealthyPodEvictionPolicy are generally available from 1.31 on."""

KEDA = "keda.sh/v1alpha1"
TERMINATION_MARGIN = 10
"""Seconds a pod's termination grace must exceed the work it waits for (closing connections)."""

# KEDA 2.x's documented fields (keda.sh/docs/<version>/reference/scaledobject-spec, the RabbitMQ
# scaler's page and TriggerAuthentication's): a misspelt field is refused, where KEDA's API
# server would silently drop it.
SCALED_OBJECT_SPEC = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
SCALE_TARGET_REF = {"apiVersion", "kind", "name", "envSourceContainerName"}
ADVANCED = {"restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig", "scalingModifiers"}
HPA_CONFIG = {"name", "behavior"}
TRIGGER = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
AUTHENTICATION_REF = {"name", "kind"}
RABBITMQ_METADATA = {
    "host",
    "hostFromEnv",
    "usernameFromEnv",
    "passwordFromEnv",
    "protocol",
    "mode",
    "value",
    "activationValue",
    "queueName",
    "vhostName",
    "useRegex",
    "excludeUnacknowledged",
    "pageSize",
    "operation",
    "timeout",
    "unsafeSsl",
}
SECRET_TARGET_REF = {"parameter", "name", "key"}

COMMANDS = {"worker": "run", "worker-relay": "relay", "worker-ingress": "serve"}
"""Each Deployment and the subcommand its container runs."""


def manifest_files() -> list[Path]:
    return sorted(path for path in DEPLOY.glob("*.yaml") if path != KUSTOMIZATION)


@functools.cache
def documents() -> tuple[dict[str, Any], ...]:
    """Every object of every manifest, the example Secret included (read once; not to be
    changed)."""
    found = []
    for path in manifest_files():
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                assert isinstance(document, dict), path.name
                found.append(document)
    return tuple(found)


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [document for document in documents() if document["kind"] == kind]


def named(kind: str, name: str) -> dict[str, Any]:
    [found] = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return found


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(workload name, pod spec) of every Deployment and Job."""
    for workload in [*of_kind("Deployment"), *of_kind("Job")]:
        yield workload["metadata"]["name"], workload["spec"]["template"]["spec"]


def container(deployment: str) -> dict[str, Any]:
    [found] = named("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return dict(found)


def environment(container: dict[str, Any]) -> dict[str, str]:
    """The variables a container gets: the ConfigMaps it reads whole, then its own ``env`` (the
    Secret's values taken from the example Secret, its placeholders filled in as a generator
    would), as Kubernetes orders them."""
    config = {d["metadata"]["name"]: d["data"] for d in of_kind("ConfigMap")}
    secrets = {d["metadata"]["name"]: d["stringData"] for d in of_kind("Secret")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config[source["configMapRef"]["name"]])
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            ref = variable["valueFrom"]["secretKeyRef"]
            example = secrets[ref["name"]][ref["key"]]
            env[variable["name"]] = re.sub(r"<[^<>]*>", "0123456789abcdef0123456789abcdef", example)
    return env


def settings_of(container: dict[str, Any]) -> Settings:
    """The settings the container's process runs with, once the example Secret's token
    placeholder (which fails validation on purpose) is replaced by a token."""
    env = environment(container)
    if "WORKER_INGRESS_TOKENS" in env:
        env["WORKER_INGRESS_TOKENS"] = "client:" + "t" * 32
    return Settings.load(env)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def named_port(container: dict[str, Any], port: str | int) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


@pytest.mark.parametrize(
    "document",
    [d for d in documents() if d["apiVersion"] != KEDA],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_each_manifest_is_valid_against_the_kubernetes_schemas(document: dict[str, Any]) -> None:
    # strict: a property the schema does not know (a misspelt field) is an error too
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_what_the_api_server_would() -> None:
    """The check above can fail: a misspelt field and a wrong type are both refused."""
    worker = named("Deployment", "worker")
    misspelt = {**worker, "spec": {**worker["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    grace = {"terminationGracePeriodSeconds": "45"}
    template = {"spec": {**worker["spec"]["template"]["spec"], **grace}}
    wrong_type = {**worker, "spec": {**worker["spec"], "template": template}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_every_manifest_but_the_example_secret() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    listed = kustomization["resources"]
    assert sorted(listed) == [p.name for p in manifest_files() if p != EXAMPLE_SECRET]
    images = {image["name"] for image in kustomization["images"]}
    used = {c["image"] for _, spec in pod_specs() for c in spec["containers"]}
    assert used == images


def test_the_migration_step_selects_the_config_then_the_job() -> None:
    """docs/kubernetes.md applies ``-l app.kubernetes.io/component=config``, then ``=migrate``,
    before everything else: each selects exactly its object."""

    def labelled(component: str) -> list[str]:
        return [
            d["kind"]
            for d in documents()
            if d["kind"] != "Secret"
            and d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        ]

    assert labelled("config") == ["ConfigMap"]
    assert labelled("migrate") == ["Job"]
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "-l app.kubernetes.io/component=config" in docs
    assert "-l app.kubernetes.io/component=migrate" in docs


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_manifests() -> None:
    """``kubectl kustomize`` builds offline; what it renders is what the files hold."""
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    expected = [d for d in documents() if d["kind"] != "Secret"]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    # and the ConfigMaps its components generate (test_prometheus_rules.py checks them)
    generated = [
        ("ConfigMap", generator["name"])
        for component in yaml.safe_load(KUSTOMIZATION.read_text()).get("components", [])
        for generator in yaml.safe_load((DEPLOY / component / "kustomization.yaml").read_text())[
            "configMapGenerator"
        ]
    ]
    assert sorted(map(key, rendered)) == sorted([*map(key, expected), *generated])
    tag = yaml.safe_load(KUSTOMIZATION.read_text())["images"][0]["newTag"]
    for document in rendered:
        if document["kind"] in ("Deployment", "Job"):
            for c in document["spec"]["template"]["spec"]["containers"]:
                assert c["image"].endswith(f":{tag}")


def test_every_worker_variable_is_a_real_setting() -> None:
    settings = {field.env for field in FIELDS}
    names: set[str] = set()
    for document in of_kind("ConfigMap"):
        names |= set(document["data"])
    for document in of_kind("Secret"):
        names |= set(document["stringData"])
    for _, spec in pod_specs():
        for c in spec["containers"]:
            names |= {variable["name"] for variable in c.get("env", [])}
    assert names, "the manifests name no variable"
    # every variable is the worker's: a typo in the prefix would slip past the next check
    assert {name for name in names if not name.startswith("WORKER_")} == set()
    assert names - settings == set()


def test_every_container_reads_settings_the_worker_accepts() -> None:
    """Each process's whole environment parses as the worker reads it (``Settings.load``)."""
    for _, spec in pod_specs():
        for c in spec["containers"]:
            settings_of(c)


def test_config_and_secret_references_exist() -> None:
    config = {d["metadata"]["name"] for d in of_kind("ConfigMap")}
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in of_kind("Secret")}
    for name, spec in pod_specs():
        for c in spec["containers"]:
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config, name
            for variable in c.get("env", []):
                if "valueFrom" in variable:
                    ref = variable["valueFrom"]["secretKeyRef"]
                    assert ref["key"] in secrets[ref["name"]], (name, ref)
                    assert ref["key"] == variable["name"], (name, ref)


def command_parses(command: list[str]) -> argparse.Namespace:
    program, *arguments = command
    assert program == "worker"
    # parse_args raises SystemExit on an unknown subcommand or flag, failing the test
    return build_parser().parse_args(arguments)


def test_each_deployment_runs_its_worker_subcommand() -> None:
    assert {d["metadata"]["name"] for d in of_kind("Deployment")} == set(COMMANDS)
    for deployment, subcommand in COMMANDS.items():
        assert command_parses(container(deployment)["command"]).command == subcommand


def test_the_migration_job_migrates() -> None:
    [job] = of_kind("Job")
    [migrate] = job["spec"]["template"]["spec"]["containers"]
    assert command_parses(migrate["command"]).command == "migrate"
    # a configuration error (exit 2) fails the Job at once, in the container that runs it
    [rule] = job["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"] == {
        "containerName": migrate["name"],
        "operator": "In",
        "values": [2],
    }


def test_the_worker_leaves_the_outbox_to_the_relay_deployment() -> None:
    assert settings_of(container("worker")).relay is False
    relay = named("Deployment", "worker-relay")
    assert command_parses(container("worker-relay")["command"]).command == "relay"
    assert relay["spec"]["replicas"] >= 1


def endpoint_status(path: str) -> int:
    """The status the worker's endpoint answers ``GET path`` with, in a process just started."""
    answer = HttpServer(Metrics(), Health()).answer(f"GET {path} HTTP/1.1".encode())
    return int(answer.split()[1])


@pytest.mark.parametrize("deployment", ["worker", "worker-relay"])
def test_worker_probes_ask_the_endpoint_on_its_port(deployment: str) -> None:
    c = container(deployment)
    settings = settings_of(c)
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe")}
    probes["readinessProbe"] = c["readinessProbe"]["httpGet"]

    # liveness asks "stuck?" only (never the database), readiness asks "working now?"
    assert probes["livenessProbe"]["path"] == "/livez"
    assert probes["startupProbe"]["path"] == "/livez"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert endpoint_status("/livez") == 200  # alive from the start, database or not
    assert endpoint_status("/readyz") == 503  # not ready before its first probe
    assert endpoint_status("/nowhere") == 404
    for probe in probes.values():
        assert named_port(c, probe["port"]) == settings.http_port
    assert settings.http_host == "0.0.0.0"  # the kubelet probes the pod's address


def test_ingress_probes_and_service_reach_the_port_it_listens_on() -> None:
    from fastapi.routing import APIRoute

    from examples.payments import router as payments
    from worker.ingress import create_app

    c = container("worker-ingress")
    settings = settings_of(c)
    app = create_app(settings, router=payments)  # builds the routes; connects to nothing
    paths = {route.path for route in app.routes if isinstance(route, APIRoute)} | {app.openapi_url}
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c[kind]["httpGet"]
        assert probe["path"] in paths, kind
        assert named_port(c, probe["port"]) == settings.ingress_port
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"  # PostgreSQL answers
    assert settings.ingress_host == "0.0.0.0"

    [service] = of_kind("Service")
    [port] = service["spec"]["ports"]
    assert named_port(c, port["targetPort"]) == settings.ingress_port


def termination_grace(deployment: str) -> int:
    spec = named("Deployment", deployment)["spec"]["template"]["spec"]
    return int(spec["terminationGracePeriodSeconds"])


@pytest.mark.parametrize("deployment", ["worker", "worker-relay"])
def test_termination_grace_outlasts_the_shutdown_grace(deployment: str) -> None:
    shutdown_grace = settings_of(container(deployment)).shutdown_grace
    assert termination_grace(deployment) >= shutdown_grace + TERMINATION_MARGIN


def test_the_ingress_stops_within_its_termination_grace() -> None:
    c = container("worker-ingress")
    sleep, seconds = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    stopping = int(seconds) + ingress_serve.SHUTDOWN_GRACE
    assert termination_grace("worker-ingress") >= stopping + TERMINATION_MARGIN


def test_selectors_select_their_own_pods() -> None:
    templates = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in of_kind("Deployment")
    }
    for deployment in of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        chosen = {n for n, labels in templates.items() if selects(selector, labels)}
        assert chosen == {name}
        # the pods spread over nodes among their own kind
        for spread in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]:
            selector = spread["labelSelector"]["matchLabels"]
            chosen = {n for n, labels in templates.items() if selects(selector, labels)}
            assert chosen == {name}
    for budget in of_kind("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        chosen = {name for name, labels in templates.items() if selects(selector, labels)}
        assert chosen == {budget["metadata"]["name"]}, budget["metadata"]["name"]
    [service] = of_kind("Service")
    chosen = {n for n, labels in templates.items() if selects(service["spec"]["selector"], labels)}
    assert chosen == {"worker-ingress"}
    # the Job's pods are nobody's
    [job] = of_kind("Job")
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    selectors = [d["spec"]["selector"]["matchLabels"] for d in of_kind("Deployment")]
    assert not any(selects(selector, job_labels) for selector in selectors)


def test_a_paused_worker_may_be_evicted_and_a_drain_keeps_one_of_each() -> None:
    for budget in of_kind("PodDisruptionBudget"):
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert named("PodDisruptionBudget", "worker")["spec"]["maxUnavailable"] == 1
    for name in ("worker-relay", "worker-ingress"):
        minimum = named("PodDisruptionBudget", name)["spec"]["minAvailable"]
        assert 1 <= minimum < named("Deployment", name)["spec"]["replicas"]


def dockerfile_user() -> int:
    [user] = re.findall(r"^USER (\d+)(?::\d+)?$", (ROOT / "Dockerfile").read_text(), re.M)
    return int(user)


def test_pods_run_unprivileged_on_a_read_only_root_filesystem() -> None:
    for name, spec in pod_specs():
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == dockerfile_user() != 0, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec["containers"]:
            own = c["securityContext"]
            assert own["allowPrivilegeEscalation"] is False, name
            assert own["readOnlyRootFilesystem"] is True, name
            assert own["capabilities"]["drop"] == ["ALL"], name


def test_every_container_requests_cpu_and_memory_and_is_bounded_in_memory() -> None:
    for name, spec in pod_specs():
        for c in spec["containers"]:
            resources = c["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), name
            assert "memory" in resources["limits"], name


def mebibytes(quantity: str) -> int:
    found = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert found is not None, f"{quantity}: write memory in Mi or Gi"
    return int(found.group(1)) * (1024 if found.group(2) == "Gi" else 1)


def test_the_worker_memory_limit_covers_a_full_prefetch() -> None:
    """An OOM kill would redeliver the same deliveries into the next one: the limit must hold
    ``prefetch`` bodies of ``max_body_bytes`` (docs/operations.md, "Memory is bounded by
    bytes"), beyond what the process needs with none."""
    c = container("worker")
    settings = settings_of(c)
    full_prefetch = settings.prefetch * settings.max_body_bytes / 2**20
    requested = mebibytes(c["resources"]["requests"]["memory"])
    assert mebibytes(c["resources"]["limits"]["memory"]) >= requested + full_prefetch


def scaled_object() -> dict[str, Any]:
    [found] = of_kind("ScaledObject")
    assert found["apiVersion"] == KEDA
    return found


def test_keda_scales_the_worker_deployment_on_the_configured_queue() -> None:
    spec = scaled_object()["spec"]
    assert set(spec) <= SCALED_OBJECT_SPEC
    assert set(spec["scaleTargetRef"]) <= SCALE_TARGET_REF
    assert spec["scaleTargetRef"]["name"] == "worker"
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    # the HorizontalPodAutoscaler owns the count: a replicas field would fight it on each apply
    assert "replicas" not in named("Deployment", "worker")["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert isinstance(spec["pollingInterval"], int)

    [trigger] = spec["triggers"]
    assert set(trigger) <= TRIGGER
    assert trigger["type"] == "rabbitmq"
    metadata = trigger["metadata"]
    assert set(metadata) <= RABBITMQ_METADATA
    assert all(isinstance(value, str) for value in metadata.values())  # KEDA: map of strings
    assert metadata["queueName"] == settings_of(container("worker")).queue
    assert metadata["mode"] == "QueueLength"
    assert metadata["protocol"] == "amqp"
    assert float(metadata["value"]) > 0
    assert "host" not in metadata  # the credentials come from the TriggerAuthentication

    assert set(trigger["authenticationRef"]) <= AUTHENTICATION_REF
    [authentication] = of_kind("TriggerAuthentication")
    assert authentication["apiVersion"] == KEDA
    assert trigger["authenticationRef"]["name"] == authentication["metadata"]["name"]
    assert set(authentication["spec"]) == {"secretTargetRef"}
    [reference] = authentication["spec"]["secretTargetRef"]
    assert set(reference) == SECRET_TARGET_REF
    assert reference["parameter"] == "host"
    # the same broker URL the worker uses (an amqp:// URL, as the scaler's amqp protocol reads)
    worker_url = next(
        v["valueFrom"]["secretKeyRef"]
        for v in container("worker")["env"]
        if v["name"] == "WORKER_AMQP_URL"
    )
    assert {"name": reference["name"], "key": reference["key"]} == worker_url
    assert settings_of(container("worker")).amqp_url.startswith("amqp")


def test_the_autoscaler_keda_makes_from_it_is_valid() -> None:
    """KEDA turns the ScaledObject into a HorizontalPodAutoscaler (autoscaling/v2) whose
    behavior is ours verbatim: that object is validated against the Kubernetes schema."""
    scaled = scaled_object()
    spec = scaled["spec"]
    advanced = spec.get("advanced", {})
    assert set(advanced) <= ADVANCED
    config = advanced.get("horizontalPodAutoscalerConfig", {})
    assert set(config) <= HPA_CONFIG
    hpa_spec: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"},
        "minReplicas": spec["minReplicaCount"],
        "maxReplicas": spec["maxReplicaCount"],
        "metrics": [
            {
                "type": "External",
                "external": {
                    "metric": {"name": "s0-rabbitmq-worker"},
                    "target": {
                        "type": "AverageValue",
                        "averageValue": spec["triggers"][0]["metadata"]["value"],
                    },
                },
            }
        ],
    }
    if "behavior" in config:
        hpa_spec["behavior"] = config["behavior"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"keda-hpa-{scaled['metadata']['name']}"},
        "spec": hpa_spec,
    }
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_the_example_secret_cannot_be_used_as_it_is() -> None:
    """Every value of secret.example.yaml is a placeholder the worker refuses to start with,
    naming the setting without echoing the value."""
    from worker.errors import ConfigurationError
    from worker.settings import Settings

    (secret,) = yaml.safe_load_all(EXAMPLE_SECRET.read_text())
    values = secret["stringData"]
    assert set(values) == {"WORKER_DATABASE_URL", "WORKER_AMQP_URL", "WORKER_INGRESS_TOKENS"}
    for name, value in values.items():
        with pytest.raises(ConfigurationError, match=f"^{name}.*placeholder") as refused:
            Settings.load({name: value})
        assert "openssl rand" in str(refused.value)
        if name == "WORKER_INGRESS_TOKENS":
            assert value not in str(refused.value)


def test_network_policies_let_in_only_the_ports_each_pod_serves() -> None:
    templates = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in (*of_kind("Deployment"), *of_kind("Job"))
    }
    policies = of_kind("NetworkPolicy")
    allowed: dict[str, set[int]] = {name: set() for name in templates}
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for name, labels in templates.items():
            if selects_pod(spec["podSelector"], labels):
                for rule in spec.get("ingress", []):
                    assert rule["from"], "a rule with no sources would let everyone in"
                    allowed[name] |= {port["port"] for port in rule["ports"]}
    # every pod of the worker is under some policy (one with no rule denies everything else)
    for name, labels in templates.items():
        assert any(selects_pod(p["spec"]["podSelector"], labels) for p in policies), name
    ports = {name: set(container_ports(name)) for name in templates}
    assert allowed == {
        "worker": ports["worker"],
        "worker-relay": ports["worker-relay"],
        "worker-ingress": ports["worker-ingress"],
        "worker-migrate": set(),
    }
    assert ports["worker"] == {9180}
    assert ports["worker-ingress"] == {8000}


def selects_pod(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and In expressions) selects pods with ``labels``."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return selects(selector.get("matchLabels", {}), labels) and all(
        labels.get(e["key"]) in e["values"] for e in expressions
    )


def container_ports(workload: str) -> list[int]:
    [spec] = [spec for name, spec in pod_specs() if name == workload]
    return [port["containerPort"] for c in spec["containers"] for port in c.get("ports", [])]
