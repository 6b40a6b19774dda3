"""deploy/prometheus and deploy/grafana: the alerting rules pass ``promtool check rules`` and their
unit tests (``promtool test rules``) fire each alert and hold it back; every metric the rules and
the dashboard query is one the worker exports, and every label value they match one it writes,
read from the exposition of a ``Metrics`` built in-process, so renaming a metric fails here and
not on an operator's dashboard at 3 a.m.; every
alert says its severity, what it means, the first command to run (a real ``worker`` command) and
its section of docs/alerts.md; the dashboard's every query goes through its ``${datasource}``
variable; ``kubectl kustomize`` ships both files unchanged.

promtool comes with Debian's ``prometheus`` package (``.ci/run`` installs it). Without it the
promtool tests are skipped, except where ``CI`` is set: there they must run, so they fail.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from markdown.extensions.toc import slugify
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.core.outcomes import Outcome
from worker.errors import Reason
from worker.ops.cli import build_parser
from worker.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "worker-alerts.yaml"
RULE_TESTS = PROMETHEUS / "worker-alerts.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "worker-dashboard.json"
KUBERNETES = ROOT / "deploy" / "kubernetes"
ALERTS_PAGE = ROOT / "docs" / "alerts.md"
KUBERNETES_VERSION = "1.31"

PROMETHEUS_OWN = {"up"}
"""Series Prometheus makes itself, whatever the target exports."""

SEVERITIES = {"critical", "warning"}
RUNBOOK = re.compile(r"^docs/alerts\.md#([a-z0-9-]+)$")

GRAFANA_SCHEMA_VERSION = 39
"""Grafana 11's dashboard schema: the oldest Grafana the dashboard is for."""

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$job": ".*", "$instance": ".*"}
"""What Grafana puts in place of the variables the dashboard's queries use, for promtool."""

_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers,
    ranges and groupings are gone, without functions (a name followed by ``(``) and keywords."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"\{[^{}]*\}", " ", expr)
    expr = re.sub(r"\[[^\[\]]*\]", " ", expr)
    expr = _GROUPING.sub(" ", expr)
    names = set()
    for word in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[word.end() :].lstrip().startswith("(") or word.group().lower() in _PROMQL_WORDS:
            continue
        names.add(word.group())
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up == 0", {"up"}),
        ('sum by (le) (rate(a_bucket{job=~"$job", x="by (y)"}[$__rate_interval]))', {"a_bucket"}),
        ("max(b) > 0 unless sum(rate(c_total[5m])) > 0", {"b", "c_total"}),
        ("up == 0 and on (job, instance) max_over_time(d[1h])", {"up", "d"}),
        ("histogram_quantile(0.95, sum by (le, handler) (rate(e[1m]))) * 60", {"e"}),
        ("absent(f) or vector(0)", {"f"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


@functools.cache
def exported_names() -> frozenset[str]:
    """Every series name ``/metrics`` can hold, from the exposition of a ``Metrics`` as the
    worker builds it (a family with no sample yet, e.g. a counter labelled by handler, is in its
    ``# TYPE`` line)."""
    text = generate_latest(Metrics().registry).decode()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        names |= {family.name + suffix for suffix in suffixes[family.type]}
        names |= {sample.name for sample in family.samples if not sample.name.endswith("_created")}
    return frozenset(names)


@functools.cache
def label_values() -> dict[str, frozenset[str]]:
    """The values each label can take: those in the exposition (the relay's results, the inbox's
    statuses, the pause reasons are there from the start), and the outcomes and dead-letter
    reasons, which appear once counted."""
    values: dict[str, set[str]] = {
        "outcome": {outcome.value for outcome in Outcome},
        "reason": {reason.value for reason in Reason},
    }
    for family in text_string_to_metric_families(generate_latest(Metrics().registry).decode()):
        for sample in family.samples:
            for label, value in sample.labels.items():
                values.setdefault(label, set()).add(value)
    return {label: frozenset(found) for label, found in values.items()}


def label_matches(expr: str) -> Iterator[tuple[str, set[str]]]:
    """Each ``label="value"`` or ``label=~"a|b"`` matcher of ``expr`` on a label of the worker's
    (not job, instance, nor a Grafana variable), with the values it names."""
    for label, operator, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', expr):
        if label not in ("job", "instance") and "$" not in value:
            yield label, set(value.split("|")) if operator == "=~" else {value}


def test_the_exported_names_are_read_from_the_exposition() -> None:
    names = exported_names()
    assert "worker_messages_total" in names  # a family with no sample yet
    assert {"worker_transaction_seconds_bucket", "worker_transaction_seconds_count"} <= names
    assert "worker_outbox_oldest_age_seconds" in names
    assert "worker_messages" not in names  # a counter's samples end in _total


# --- the rules -----------------------------------------------------------------------------------


@functools.cache
def rule_groups() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert isinstance(groups, list)
    return groups


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def alert_names() -> list[str]:
    return [rule["alert"] for rule in alerts()]


def promtool() -> str:
    """promtool's path; skips the test without it, or fails it where ``CI`` is set."""
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool is not installed (Debian's prometheus package ships it)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is set, where the alerting rules must be checked")
        pytest.skip(reason)
    return found


def run_promtool(*arguments: str, cwd: Path = PROMETHEUS) -> str:
    result = subprocess.run(
        [promtool(), *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_promtool_check_rules() -> None:
    output = run_promtool("check", "rules", RULES.name)
    assert f"SUCCESS: {len(alerts())} rules found" in output


def test_promtool_test_rules() -> None:
    assert "SUCCESS" in run_promtool("test", "rules", RULE_TESTS.name)


def test_the_rule_tests_can_fail(tmp_path: Path) -> None:
    """promtool's verdict is read: a rule test that expects the wrong thing fails."""
    shutil.copy(RULES, tmp_path / RULES.name)
    tests = yaml.safe_load(RULE_TESTS.read_text())
    case = tests["tests"][0]["alert_rule_test"][0]
    assert case["exp_alerts"] == []
    case["exp_alerts"] = [{"exp_labels": {"severity": "warning"}}]
    (tmp_path / RULE_TESTS.name).write_text(yaml.safe_dump(tests))
    with pytest.raises(AssertionError, match="FAILED"):
        run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)


def test_each_alert_is_tested_firing_and_held_back() -> None:
    fired: set[str] = set()
    held: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else held).add(check["alertname"])
    assert set(alert_names()) - fired == set(), "alerts no test fires"
    assert set(alert_names()) - held == set(), "alerts no test holds back"
    assert (fired | held) - set(alert_names()) == set(), "tests of alerts that do not exist"


def test_the_rules_query_only_metrics_the_worker_exports() -> None:
    for rule in alerts():
        names = promql_metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names - exported_names() - PROMETHEUS_OWN == set(), rule["alert"]
        for label, values in label_matches(rule["expr"]):
            assert values <= label_values()[label], rule["alert"]


def documented_anchors() -> set[str]:
    """The anchors of docs/alerts.md's headings, as MkDocs makes them (``toc``'s slugify)."""
    headings = re.findall(r"^#+ (.+?)\s*$", ALERTS_PAGE.read_text(), re.M)
    return {slugify(heading, "-") for heading in headings}


def test_each_alert_says_how_bad_what_it_means_and_where_its_runbook_is() -> None:
    assert len(set(alert_names())) == len(alert_names()), "an alert name used twice"
    anchors = documented_anchors()
    for rule in alerts():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        runbook = RUNBOOK.match(annotations["runbook_url"])
        assert runbook is not None, name
        assert runbook.group(1) == slugify(name, "-"), name
        assert runbook.group(1) in anchors, f"{name}: no section of docs/alerts.md"


def commands_in(text: str) -> Iterator[list[str]]:
    """The ``worker …`` commands quoted in ``text``, their templates filled in."""
    for quoted in re.findall(r"`(worker [^`]+)`", text):
        filled = re.sub(r"\{\{[^}]*\}\}", "x", quoted)
        yield shlex.split(filled)


def test_the_commands_the_alerts_name_are_real() -> None:
    parser = build_parser()
    for rule in alerts():
        commands = list(commands_in(rule["annotations"]["description"]))
        assert commands, f"{rule['alert']} names no first command to run"
        for command in commands:
            # parse_args exits on an unknown subcommand or flag, failing the test
            parser.parse_args(command[1:])


def test_the_alerts_page_has_a_section_for_each_alert_and_no_other() -> None:
    sections = set(re.findall(r"^### (Worker\w+)\s*$", ALERTS_PAGE.read_text(), re.M))
    assert sections == set(alert_names())


def test_the_rules_wrapped_as_docs_say_make_a_prometheus_rule() -> None:
    """docs/alerts.md wraps the file in a PrometheusRule for the Prometheus Operator by
    indenting it under ``spec:``: that holds the same groups."""
    page = ALERTS_PAGE.read_text()
    header = "apiVersion: monitoring.coreos.com/v1\\nkind: PrometheusRule\\n"
    assert header in page
    assert "sed 's/^/  /' deploy/prometheus/worker-alerts.yaml" in page
    [printed] = re.findall(r"printf '([^']*)'", page)
    wrapped = printed.replace("\\n", "\n") + re.sub(r"(?m)^", "  ", RULES.read_text())
    rule = yaml.safe_load(wrapped)
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"] == {"groups": rule_groups()}


# --- the dashboard -------------------------------------------------------------------------------


@functools.cache
def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def dashboard_queries() -> list[str]:
    queries = [target["expr"] for panel in panels() for target in panel["targets"]]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable["query"]["query"])
            assert found is not None, variable["name"]
            queries.append(found.group(1))
    return queries


def test_the_dashboard_is_for_a_current_grafana_and_chooses_its_datasource() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= GRAFANA_SCHEMA_VERSION
    assert board["uid"]
    assert board["title"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # the variable's current value is chosen where it is loaded: none is written in
    assert variables["datasource"]["current"] == {}


def datasources(node: Any) -> Iterator[Any]:
    """Every ``datasource`` value anywhere in the JSON."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            yield from datasources(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasources(item)


def test_every_panel_and_query_asks_the_datasource_variable() -> None:
    for panel in panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    # no datasource uid written in anywhere, but Grafana's own annotations
    grafana_own = {"type": "grafana", "uid": "-- Grafana --"}
    assert [d for d in datasources(dashboard()) if d not in (DATASOURCE, grafana_own)] == []


def test_the_panels_are_laid_out_once_each() -> None:
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard()["panels"]:
        place = panel["gridPos"]
        assert place["x"] >= 0, panel["title"]
        assert place["x"] + place["w"] <= 24, panel["title"]
        assert panel["type"] == "row" or panel["description"], panel["title"]


def test_the_dashboard_queries_only_metrics_the_worker_exports() -> None:
    used: set[str] = set()
    for query in dashboard_queries():
        names = promql_metric_names(query)
        assert names, query
        used |= names
        for label, values in label_matches(query):
            assert values <= label_values()[label], query
    assert used - exported_names() == set()
    # and shows every one of them: a metric added to the worker gets a panel
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported_names()}
    shown = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert families - shown == set()


def test_the_dashboard_queries_are_promql(tmp_path: Path) -> None:
    """promtool parses each query, Grafana's variables put in as Grafana would."""
    rules = []
    for number, query in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        assert "$" not in query, query
        rules.append({"record": f"dashboard:query_{number}", "expr": query})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool("check", "rules", path.name, cwd=tmp_path)


# --- shipped by the Kubernetes manifests ---------------------------------------------------------


def component_files() -> dict[str, Path]:
    """Each ConfigMap the kustomization's components generate, and the file it holds."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    found = {}
    for component in kustomization["components"]:
        directory = (KUBERNETES / component).resolve()
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert spec["kind"] == "Component"
        for generator in spec["configMapGenerator"]:
            [name] = generator["files"]
            found[generator["name"]] = directory / name
    return found


def test_the_kustomization_ships_the_rules_and_the_dashboard() -> None:
    assert set(component_files().values()) == {RULES, DASHBOARD}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_them_as_config_maps_unchanged() -> None:
    # check_output raises on a failed build, failing the test
    built = subprocess.check_output(
        ["kubectl", "kustomize", str(KUBERNETES)], text=True, timeout=60
    )
    config_maps = {
        document["metadata"]["name"]: document
        for document in yaml.safe_load_all(built)
        if document and document["kind"] == "ConfigMap"
    }
    for name, path in component_files().items():
        kubernetes_validate.validate(config_maps[name], KUBERNETES_VERSION, strict=True)
        assert config_maps[name]["data"] == {path.name: path.read_text()}
        # `kubectl apply` copies the object into an annotation, and annotations hold 256 KiB
        assert len(path.read_bytes()) < 256 * 1024
    dashboard_labels = config_maps["worker-grafana-dashboard"]["metadata"]["labels"]
    assert dashboard_labels["grafana_dashboard"] == "1"  # the Grafana sidecar's label
