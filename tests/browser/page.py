"""``Page``: the browser as a test drives it, each call run in a thread so that the console,
served from the test's event loop, answers while the browser waits; and ``screenshot``, which
writes the documentation's pictures when ``WORKER_CONSOLE_SCREENSHOTS=1``."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
WAIT = 15.0
"""Seconds a step waits for the page it expects."""
LONGEST_SCREENSHOT = 2000
"""Pixels a screenshot of a whole page is cut to."""

T = TypeVar("T")


def screenshot_path(name: str, elsewhere: Path) -> Path:
    """Where the screenshot ``name`` goes: ``docs/images/console-<name>.png`` when
    ``WORKER_CONSOLE_SCREENSHOTS=1`` (the docs' pictures are made by the tests), else into
    ``elsewhere`` (a test's tmp_path), so an ordinary run leaves the checkout as it was."""
    if os.environ.get("WORKER_CONSOLE_SCREENSHOTS") == "1":
        return IMAGES / f"console-{name}.png"
    return elsewhere / f"console-{name}.png"


@dataclass
class Page:
    """The session's browser, on one console at ``base``."""

    driver: WebDriver
    base: str
    tmp_path: Path

    async def _run(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(call, *args)

    def _waiting(self, timeout: float = WAIT) -> WebDriverWait[WebDriver]:
        """A wait of ``timeout`` seconds that tries again when the page it looked at was
        replaced meanwhile (a navigation under way, a live part refreshed)."""
        return WebDriverWait(
            self.driver, timeout, ignored_exceptions=(StaleElementReferenceException,)
        )

    async def clear_cookies(self) -> None:
        """Forget every cookie of every site (a test starts logged out everywhere)."""
        await self._run(self.driver.execute_cdp_cmd, "Network.clearBrowserCookies", {})

    async def open(self, url: str) -> None:
        """Go to ``url``: a path of the console, or a whole URL."""
        await self._run(self.driver.get, url if "://" in url else self.base + url)

    async def path(self) -> str:
        """The current page's path (and query)."""
        url = urlsplit(await self._run(lambda: self.driver.current_url))
        return url.path + (f"?{url.query}" if url.query else "")

    async def wait_for_path(self, path: str) -> None:
        """Wait until the browser is on ``path`` (its query left aside)."""

        def there(driver: WebDriver) -> bool:
            return urlsplit(driver.current_url).path == path

        await self._run(self._waiting().until, there)

    async def wait_for_path_under(self, prefix: str) -> str:
        """Wait until the browser is on a path that starts with ``prefix``; that path."""

        def there(driver: WebDriver) -> str | bool:
            path = urlsplit(driver.current_url).path
            return path if path.startswith(prefix) else False

        found: str = await self._run(self._waiting().until, there)
        return found

    async def wait_for_text(self, css: str, text: str) -> str:
        """Wait until an element matching ``css`` shows ``text``; the element's whole text."""

        def shown(driver: WebDriver) -> str | bool:
            for element in driver.find_elements(By.CSS_SELECTOR, css):
                if text in element.text:
                    return str(element.text)
            return False

        found: str = await self._run(self._waiting().until, shown)
        return found

    async def text(self, css: str) -> str:
        """The visible text of the first element matching ``css``."""
        return str(await self._run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).text))

    async def texts(self, css: str) -> list[str]:
        """The visible text of every element matching ``css``."""
        return await self._run(
            lambda: [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, css)]
        )

    async def attribute(self, css: str, name: str) -> str | None:
        """Attribute ``name`` of the first element matching ``css``."""
        return await self._run(
            lambda: self.driver.find_element(By.CSS_SELECTOR, css).get_attribute(name)
        )

    async def type(self, css: str, text: str) -> None:
        """Type ``text`` into the field matching ``css``, as a user would."""
        await self._run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).send_keys(text))

    async def click(self, css: str) -> None:
        await self._run(lambda: self.driver.find_element(By.CSS_SELECTOR, css).click())

    async def script(self, source: str, *args: Any) -> Any:
        """Run ``source`` in the page (through the driver: as a user's devtools would)."""
        return await self._run(self.driver.execute_script, source, *args)

    async def wait_for(self, source: str, *args: Any, timeout: float = WAIT) -> Any:
        """Wait until the script ``source`` (run in the page, as ``script`` runs it) returns
        something true; that value."""

        def returned(driver: WebDriver) -> Any:
            return driver.execute_script(source, *args)

        return await self._run(self._waiting(timeout).until, returned)

    async def click_and_wait(self, css: str, path: str) -> None:
        """Click the element matching ``css`` and wait for the page at ``path`` it leads to."""
        await self.click(css)
        await self.wait_for_path(path)

    async def bypass_csp(self, bypass: bool) -> None:
        """Have the browser ignore the Content-Security-Policy of the pages it loads from now on
        (or obey it again): a test of the escaping alone, which the policy would otherwise back
        up (an inline script that slipped through would be blocked, not run)."""
        await self._run(self.driver.execute_cdp_cmd, "Page.setBypassCSP", {"enabled": bypass})

    async def source(self) -> str:
        """The page's HTML as the browser holds it now."""
        return str(await self._run(lambda: self.driver.page_source))

    async def log_in(self, token: str, *, start: str = "/") -> None:
        """Log in through the form, as a person does: open ``start``, land on the login page,
        type the token, click the button; wait for the page the login leads back to."""
        await self.open(start)
        await self.wait_for_path("/login")
        await self.type("#token", token)
        await self.click("#login")

        def logged_in(driver: WebDriver) -> bool:
            return urlsplit(driver.current_url).path != "/login"

        await self._run(self._waiting().until, logged_in)

    async def screenshot(self, name: str, *, whole: bool = False) -> Path:
        """Save what the browser shows (see ``screenshot_path``), or with ``whole`` the whole
        page down to its end (at most ``LONGEST_SCREENSHOT`` pixels); its path."""
        path = screenshot_path(name, self.tmp_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not whole:
            saved = await self._run(self.driver.save_screenshot, str(path))
            assert saved, f"no screenshot saved at {path}"
            return path
        width, height = await self.script(
            "return [window.innerWidth, document.documentElement.scrollHeight];"
        )
        shot = await self._run(
            self.driver.execute_cdp_cmd,
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {
                    "x": 0,
                    "y": 0,
                    "width": width,
                    "height": min(height, LONGEST_SCREENSHOT),
                    "scale": 1,
                },
            },
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
