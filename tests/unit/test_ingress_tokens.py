"""The ingress's token setting: each token speaks for a client, and a setting that is blank or
malformed stops every command at start, naming the setting and never repeating its value (from
the environment, from the flag, in the message or in the chained exception)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import yaml

from tests.helpers import WORKER_SCRIPT, run
from worker.errors import ConfigurationError
from worker.ingress.auth import ANONYMOUS, Tokens
from worker.settings import Settings, token_client

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Sup3r-secret-value-of-the-test"
"""A valid token planted beside the malformed entry: no message may show it."""


def test_a_named_token_speaks_for_its_client_and_a_bare_one_for_its_own() -> None:
    tokens = Tokens((f"alice:{SECRET}", "alice:another-token-0123456", "bare-token-0123456789"))

    assert tokens.client(f"Bearer {SECRET}") == "alice"
    assert tokens.client("bearer another-token-0123456") == "alice"
    bare = tokens.client("Bearer bare-token-0123456789")
    assert bare is not None
    assert bare.startswith("token-")
    assert "0123456789" not in bare
    assert bare == token_client("bare-token-0123456789")[0]
    assert tokens.client(f"Basic {SECRET}") is None
    assert tokens.client(f"Bearer {SECRET}x") is None
    assert tokens.client(None) is None
    assert Tokens(()).client(None) == ANONYMOUS


@pytest.mark.parametrize(
    "value",
    [
        ",",
        " , ",
        f"{SECRET},",
        f"{SECRET},,other-token-0123456789",
        f"{SECRET},short",
        f"{SECRET},has a space-0123456789",
        f"{SECRET},bad name!:good-token-0123456789",
        f"{SECRET},alice:",
    ],
    ids=[
        "comma",
        "blank-entries",
        "trailing-comma",
        "empty-entry",
        "short",
        "space",
        "name",
        "no-token",
    ],
)
def test_a_blank_or_malformed_token_setting_names_the_variable_not_its_value(value: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Settings.load({"WORKER_INGRESS_TOKENS": value})

    shown = "".join(traceback.format_exception(refused.value))
    assert "WORKER_INGRESS_TOKENS" in str(refused.value)
    assert SECRET not in shown
    for part in value.split(","):
        if len(part.strip()) > 3:
            assert part.strip() not in shown, part


def test_worker_serve_with_a_malformed_token_exits_2_naming_the_variable_only() -> None:
    from_environment = run(
        WORKER_SCRIPT, "serve", WORKER_INGRESS_TOKENS=f"{SECRET},not a token-0123456789"
    )
    from_flag = run(WORKER_SCRIPT, "serve", "--ingress-tokens", f"{SECRET},short")

    for result in (from_environment, from_flag):
        output = result.stdout + result.stderr
        assert result.returncode == 2, output
        assert "INGRESS_TOKENS" in output or "--ingress-tokens" in output, output
        assert SECRET not in output, output
        assert "not a token" not in output, output
        assert ",short" not in output, output


def test_the_example_token_of_the_deployment_is_a_placeholder_that_fails_validation() -> None:
    secret = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "secret.example.yaml").read_text())
    example = secret["stringData"]["WORKER_INGRESS_TOKENS"]

    with pytest.raises(ConfigurationError, match="WORKER_INGRESS_TOKENS"):
        Settings.load({"WORKER_INGRESS_TOKENS": example})
