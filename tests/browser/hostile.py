"""What a hostile sender puts in a message for the browser tests (markup that would run a
script where it took effect, a right-to-left override, bytes that are not UTF-8), and the check
that none of it took effect in the page the browser shows: run with the page's
Content-Security-Policy bypassed (``Page.bypass_csp``), it tests the escaping alone."""

from __future__ import annotations

from tests.browser.page import Page
from tests.integration.test_hostile_input import INVALID_UTF8, TERMINAL_TRICKS

PWNED = "window.__pwned=1"
SCRIPT = f"<script>{PWNED}</script>"
IMAGE = f'<img src=x onerror="{PWNED}">'
RIGHT_TO_LEFT = TERMINAL_TRICKS[4]
"""``\\u202egnp.exe``: reads ``exe.png`` where the override is obeyed."""
RIGHT_TO_LEFT_SHOWN = "\\u202egnp.exe"
"""How a page shows it: the override written as an escape."""
NOT_UTF8 = b"".join(INVALID_UTF8[:3])
NOT_UTF8_SHOWN = "\\xff\\xc3\\xed\\xa0\\x80"
"""How a page shows those bytes."""
BODY = (SCRIPT + IMAGE + RIGHT_TO_LEFT).encode() + NOT_UTF8
BODY_SHOWN = SCRIPT + IMAGE + RIGHT_TO_LEFT_SHOWN + NOT_UTF8_SHOWN

LIVE = """
const planted = Array.from(document.querySelectorAll("*")).filter((element) =>
  Array.from(element.attributes).some((attribute) => attribute.name.startsWith("on")));
return {
  pwned: typeof window.__pwned,
  images: document.querySelectorAll("img, image").length,
  scripts: Array.from(document.scripts)
    .map((script) => (script.src ? new URL(script.src).pathname : script.textContent)),
  handlers: planted.map((element) => element.tagName),
};
"""
"""What of the hostile markup is live in the page: whether its script ran, how many images and
scripts the DOM has, which elements carry an event handler attribute."""


async def assert_inert(page: Page) -> str:
    """Assert that nothing a message carried is live in the page (no script of it ran, no
    element of it exists, no character of it reorders the text); the page's text."""
    assert await page.script(LIVE) == {
        "pwned": "undefined",
        "images": 0,
        "scripts": ["/static/console.js"],
        "handlers": [],
    }
    shown = await page.text("main")
    assert "\u202e" not in shown
    return shown
