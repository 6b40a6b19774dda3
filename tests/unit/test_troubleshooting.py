"""Every error sentence the worker prints has an entry on docs/troubleshooting.md, found from the
code itself: a new sentence without its entry fails here.

The sentences are read from every module of the ``worker`` package (imported, then parsed): the
default message of each ``WorkerError`` class (its docstring), the message each is raised with,
what the CLI prints after ``worker: error:``, and the sentences that name a fix (``...: fix the
user or password in WORKER_DATABASE_URL``) a function returns or a table holds. A sentence's
variable parts (``{...}`` in an f-string) are written ``…`` on the page; its fixed parts must
stand in that order on one line of it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import worker
from worker.errors import WorkerError

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
HOLE = "\x00"  # where an f-string's value goes
PRINTED = "worker: error: "
NAMES_A_FIX = re.compile(r"[:;?] (fix|check|create|enable|lower|set|declare|run)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Sentence:
    text: str  # fixed parts, HOLE where a value goes
    where: str

    def fragments(self) -> list[str]:
        return [" ".join(part.replace("`", "").split()) for part in self.text.split(HOLE)]

    def says_something(self) -> bool:
        """Not a mere frame around values (``{exc}``, ``{what}: {why}``)."""
        return any(re.search(r"[A-Za-z]{3}", part) for part in self.fragments())


def modules() -> list[ModuleType]:
    """Every module of the ``worker`` package, imported (the test extra has every extra's
    packages)."""
    found = [worker]
    for info in pkgutil.walk_packages(worker.__path__, "worker."):
        if ".migrations" in info.name or info.name.endswith(".__main__"):
            continue  # Alembic's scripts, and `python -m worker`, which runs the CLI
        found.append(importlib.import_module(info.name))
    return found


def error_classes() -> list[type[WorkerError]]:
    modules()  # every subclass defined
    found: list[type[WorkerError]] = []
    pending: list[type[WorkerError]] = [WorkerError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return [cls for cls in found if cls.__module__.startswith("worker")]


def _text(node: ast.expr) -> str | None:
    """A string literal's text, an f-string's with ``HOLE`` for each value; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [_text(value) if isinstance(value, ast.Constant) else HOLE for value in node.values]
        return "".join(part or "" for part in parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def _raised_with(call: ast.Call, names: set[str]) -> ast.expr | None:
    called = call.func
    name = called.id if isinstance(called, ast.Name) else getattr(called, "attr", None)
    if name not in names:
        return None
    if call.args:
        return call.args[0]
    return next((kw.value for kw in call.keywords if kw.arg == "message"), None)


def _in_source(module: ModuleType, names: set[str]) -> Iterator[Sentence]:
    tree = ast.parse(inspect.getsource(module))
    inside_fstrings = {
        id(value)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for value in node.values
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (message := _raised_with(node, names)) is not None:
            found = [(message, lambda text: True)]  # raise ConfigurationError("...")
        elif isinstance(node, ast.Return) and node.value is not None:
            found = [(node.value, NAMES_A_FIX.search)]
        elif isinstance(node, ast.Dict):
            found = [(value, NAMES_A_FIX.search) for value in node.values]
        elif isinstance(node, ast.JoinedStr | ast.Constant) and id(node) not in inside_fstrings:
            found = [(node, lambda text: text.startswith(PRINTED))]
        else:
            continue
        for candidate, wanted in found:
            text = _text(candidate)
            if text is not None and wanted(text):
                yield Sentence(text.removeprefix(PRINTED), f"{module.__name__}:{candidate.lineno}")


def sentences() -> list[Sentence]:
    classes = error_classes()
    found = [
        Sentence(" ".join(cls.__doc__.split("\n\n")[0].split()), cls.__qualname__)
        for cls in classes
        if cls.__doc__
    ]
    names = {cls.__name__ for cls in classes}
    for module in modules():
        found.extend(_in_source(module, names))
    return [sentence for sentence in found if sentence.says_something()]


def on_the_page(sentence: Sentence, lines: list[str]) -> bool:
    pattern = re.compile(".*?".join(re.escape(part) for part in sentence.fragments() if part))
    return any(pattern.search(line) for line in lines)


def test_every_error_sentence_has_an_entry() -> None:
    lines = [" ".join(line.replace("`", "").split()) for line in PAGE.read_text().splitlines()]
    missing = [s for s in sentences() if not on_the_page(s, lines)]
    assert not missing, "sentences without an entry on docs/troubleshooting.md:\n" + "\n".join(
        f"  {s.where}: {s.text.replace(HOLE, '…')}" for s in missing
    )


def test_the_sentences_are_found_where_they_are_made() -> None:
    """The search finds each kind of sentence: a class's default message, a message raised, a
    printed error and a fix a function returns (so an empty search cannot pass the test
    above)."""
    texts = {sentence.text for sentence in sentences()}
    assert "The worker's configuration is invalid." in texts
    assert f"no handler for routing key {HOLE}" in texts
    assert any(text.startswith("RabbitMQ says ") for text in texts)
    assert "RabbitMQ refused the login: fix the user or password in WORKER_AMQP_URL" in texts
    assert any(text.startswith("cannot reach ") for text in texts)
    assert len(texts) > 100


def test_a_sentence_matches_only_with_its_fixed_parts_in_order() -> None:
    sentence = Sentence(f"idempotency key is longer than {HOLE} characters", "here")
    assert on_the_page(sentence, ["| idempotency key is longer than … characters | shorten it |"])
    assert not on_the_page(sentence, ["| characters … idempotency key is longer than |"])
    assert not on_the_page(sentence, ["idempotency key is longer than", "… characters"])
