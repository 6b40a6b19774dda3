"""The console driven in a real browser: Debian's headless Chromium through its chromedriver
(both at their Debian paths, given to Selenium explicitly, so Selenium Manager never downloads
anything), one browser for the session, on the integration tests' database and broker.

Without Chromium or its driver the tests are skipped, except where ``CI`` is set: there they
must run, so they fail (``.ci/run`` installs both). A test drives the browser through ``Page``,
whose calls run in a thread: the console under test serves from the test's own event loop,
which must keep running while the browser waits for it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

from tests.browser.page import Page
from tests.integration.conftest import (  # the integration tests' database, broker and names
    amqp,
    clean_tables,
    database_url,
    engine,
    settings,
)
from tests.integration.console_support import RunningConsole, running_console
from worker.settings import Settings

__all__ = ["amqp", "clean_tables", "database_url", "engine", "settings"]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1280, 900)
ARGUMENTS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)


def require_browser() -> None:
    """Skip without Chromium and its driver; fail instead where ``CI`` is set."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.is_file()]
    if not missing:
        return
    reason = (
        f"{' and '.join(missing)} not installed (Debian: apt-get install chromium chromium-driver)"
    )
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def driver() -> Iterator[WebDriver]:
    """One headless Chromium for the session, its window 1280x900."""
    require_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ARGUMENTS:
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
async def console(settings: Settings) -> AsyncIterator[RunningConsole]:
    """The console for this test, on its database and broker names."""
    async with running_console(settings) as running:
        yield running


@pytest.fixture
async def page(driver: WebDriver, console: RunningConsole, tmp_path: Path) -> Page:
    """The browser, its cookies cleared, pointed at this test's console."""
    browser = Page(driver, console.url, tmp_path)
    await browser.clear_cookies()
    return browser
