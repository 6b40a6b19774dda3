"""The browser harness's own rules: without Chromium the tests skip, but fail where ``CI`` is
set (so CI never passes by skipping them); screenshots go to the docs only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import conftest
from tests.browser.page import screenshot_path


def test_without_chromium_the_browser_tests_skip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(conftest, "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.delenv("CI", raising=False)

    with pytest.raises(pytest.skip.Exception, match="no-chromium not installed"):
        conftest.require_browser()


def test_without_chromedriver_the_browser_tests_fail_where_ci_is_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(conftest, "CHROMEDRIVER", tmp_path / "no-chromedriver")
    monkeypatch.setenv("CI", "true")

    with pytest.raises(pytest.fail.Exception, match="no-chromedriver not installed"):
        conftest.require_browser()


def test_screenshots_go_to_the_docs_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("WORKER_CONSOLE_SCREENSHOTS", raising=False)
    assert screenshot_path("audit", tmp_path) == tmp_path / "console-audit.png"

    monkeypatch.setenv("WORKER_CONSOLE_SCREENSHOTS", "1")
    docs_images = Path(__file__).resolve().parents[2] / "docs" / "images"
    assert screenshot_path("audit", tmp_path) == docs_images / "console-audit.png"
