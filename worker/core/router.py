"""Handlers and the router that holds them: which function serves which routing key.

A handler is an ``async def handler(body, ctx)``. The annotation of ``body`` says how the decoded
JSON is validated before the handler runs: a pydantic model, a dataclass, a TypedDict, ``dict``,
or nothing (the JSON value as it is). One routing key has exactly one handler.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import MetaData

from worker.core.handler import Handler, HandlerKind
from worker.core.signals import Signal
from worker.errors import HandlerRegistrationError

if TYPE_CHECKING:
    from worker.core.context import Batch, Context
    from worker.core.workflows import Workflow

HandlerFunc = Callable[[Any, "Context"], Awaitable[Any]]
WorkflowFunc = Callable[[Any, "Workflow"], Awaitable[Any]]
BatchHandlerFunc = Callable[[list[Any], "Batch"], Awaitable["Sequence[Any] | None"]]


def _body_type(func: Callable[..., Awaitable[Any]], *, batch: bool = False) -> Any:
    """The body type a handler's first parameter declares; for a batch handler, the ``T`` of its
    ``list[T]`` (or ``Sequence[T]``)."""
    params = list(inspect.signature(func).parameters.values())
    if len(params) != 2:
        expected = "(bodies, batch)" if batch else "(body, ctx)"
        raise HandlerRegistrationError(
            f"handler {func.__qualname__} must take two parameters {expected}, not {len(params)}"
        )
    try:
        hints = typing.get_type_hints(func)
    except NameError as exc:
        raise HandlerRegistrationError(
            f"cannot resolve the annotations of {func.__qualname__}: {exc}"
        ) from exc
    declared = hints.get(params[0].name, Any)
    if not batch or declared is Any:
        return declared
    if typing.get_origin(declared) not in (list, Sequence) or len(typing.get_args(declared)) != 1:
        raise HandlerRegistrationError(
            f"batch handler {func.__qualname__} must annotate its bodies as list[T], "
            f"not {declared!r}"
        )
    return typing.get_args(declared)[0]


def _declared(publishes: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """A handler's ``publishes``, checked: routing keys (no wildcards) to body types."""
    for routing_key in publishes or {}:
        if not isinstance(routing_key, str) or not routing_key or "*" in routing_key:
            raise HandlerRegistrationError(f"publishes: {routing_key!r} is not a routing key")
    return tuple((publishes or {}).items())


class Router:
    """A set of handlers, with the Alembic migrations of the tables they own, if any.

    ``name`` names the module's migration history (its version table is
    ``alembic_version_<name>``); ``migrations`` is the folder of its Alembic revisions and
    ``metadata`` the SQLAlchemy metadata they create.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        migrations: str | Path | None = None,
        metadata: MetaData | None = None,
    ) -> None:
        if migrations is not None and name is None:
            raise HandlerRegistrationError("a router with migrations needs a name")
        self.name = name
        self.migrations = Path(migrations) if migrations is not None else None
        self.metadata = metadata
        self._handlers: dict[str, Handler] = {}
        self._children: list[Router] = []
        self._parent: Router | None = None
        self._signals: dict[str, Signal] = {}

    def handler(
        self,
        routing_key: str,
        *,
        name: str | None = None,
        publishes: Mapping[str, Any] | None = None,
    ) -> Callable[[HandlerFunc], HandlerFunc]:
        """Register the decorated coroutine function as the handler of ``routing_key``.

        ``name`` (default: the routing key) is stored with every idempotency key; keep it stable,
        or earlier deliveries are no longer recognised as duplicates. ``publishes`` maps the
        routing keys of the events it emits to their body types, for ``worker asyncapi``.
        """

        def register(func: HandlerFunc) -> HandlerFunc:
            if not inspect.iscoroutinefunction(func):
                raise HandlerRegistrationError(f"handler {func.__qualname__} must be async def")
            self._add(
                Handler(
                    name or routing_key,
                    routing_key,
                    func,
                    _body_type(func),
                    publishes=_declared(publishes),
                )
            )
            return func

        return register

    def workflow(
        self,
        routing_key: str,
        *,
        name: str | None = None,
        publishes: Mapping[str, Any] | None = None,
    ) -> Callable[[WorkflowFunc], WorkflowFunc]:
        """Register the decorated coroutine function as a multi-step workflow for ``routing_key``.

        It is called as ``func(body, wf)`` with a ``worker.Workflow``; each ``await wf.step(...)``
        runs in a transaction of its own, and a redelivery resumes after the last committed step.
        ``name`` and ``publishes`` as for ``handler``.
        """

        def register(func: WorkflowFunc) -> WorkflowFunc:
            if not inspect.iscoroutinefunction(func):
                raise HandlerRegistrationError(f"workflow {func.__qualname__} must be async def")
            body_type = _body_type(func)
            self._add(
                Handler(
                    name or routing_key,
                    routing_key,
                    func,
                    body_type,
                    HandlerKind.WORKFLOW,
                    _declared(publishes),
                    declares_signal=self.declares_signal,
                )
            )
            return func

        return register

    def signal(
        self,
        routing_key: str,
        *,
        field: str | None = None,
        header: str | None = None,
        name: str | None = None,
        body: Any = Any,
    ) -> None:
        """Declare ``routing_key`` a signal for workflows that ``wf.wait_for`` it: its
        correlation is the top-level ``field`` of its JSON object body, or its ``header``
        (exactly one; a string, or an integer taken as its decimal string).

        It is served by a built-in handler (``name``: default the routing key), so a signal is
        bound, deduplicated by the inbox and failed like any message; one whose correlation is
        missing or unusable is parked. ``body`` is its body type, checked as a handler's is: a
        signal that fails it is parked as ``invalid`` before it resolves any wait, so a waiting
        workflow only ever resumes with a body of that type (``wait_for`` returns it as JSON).
        It resumes the waits for its correlation that are open, else it is kept for the next
        wait for it (until the inbox's retention).
        """
        declared = Signal(routing_key, field=field, header=header)
        self._add(Handler(name or routing_key, routing_key, declared.handle, body))
        self._signals[routing_key] = declared

    def declares_signal(self, routing_key: str) -> bool:
        """Whether ``routing_key`` is a signal declared in this router's tree (the router it is
        included in, any router included there)."""
        root = self
        while root._parent is not None:
            root = root._parent
        stack = [root]
        while stack:
            router = stack.pop()
            if routing_key in router._signals:
                return True
            stack.extend(router._children)
        return False

    def batch_handler(
        self,
        routing_key: str,
        *,
        name: str | None = None,
        publishes: Mapping[str, Any] | None = None,
    ) -> Callable[[BatchHandlerFunc], BatchHandlerFunc]:
        """Register the decorated coroutine function as the batch handler of ``routing_key``.

        It is called as ``func(bodies, batch)`` with the bodies of a batch's messages of this
        routing key (distinct keys, in key order) and a ``worker.Batch`` holding each message's
        ``Context``, for set-based writes in the batch's one transaction. It returns None or one
        result per body, stored with that body's key. A message handled alone comes as a batch
        of one. ``name`` and ``publishes`` as for ``handler``.
        """

        def register(func: BatchHandlerFunc) -> BatchHandlerFunc:
            if not inspect.iscoroutinefunction(func):
                raise HandlerRegistrationError(
                    f"batch handler {func.__qualname__} must be async def"
                )
            body_type = _body_type(func, batch=True)
            self._add(
                Handler(
                    name or routing_key,
                    routing_key,
                    func,
                    body_type,
                    HandlerKind.BATCH,
                    _declared(publishes),
                )
            )
            return func

        return register

    def include(self, other: Router) -> None:
        """Serve ``other``'s handlers too; its migrations stay its own."""
        for handler in other.handlers():
            self._add(handler)
        self._children.append(other)
        other._parent = self

    def _add(self, handler: Handler) -> None:
        if "*" in handler.routing_key or "#" in handler.routing_key:
            raise HandlerRegistrationError(
                f"routing key {handler.routing_key!r}: wildcards are not supported; "
                "register each routing key"
            )
        if handler.routing_key in self._handlers:
            raise HandlerRegistrationError(
                f"routing key {handler.routing_key!r} already has a handler"
            )
        if any(h.name == handler.name for h in self._handlers.values()):
            raise HandlerRegistrationError(f"handler name {handler.name!r} is already taken")
        self._handlers[handler.routing_key] = handler

    def handlers(self) -> list[Handler]:
        return list(self._handlers.values())

    def routing_keys(self) -> list[str]:
        return sorted(self._handlers)

    def find(self, routing_key: str) -> Handler | None:
        return self._handlers.get(routing_key)

    def with_migrations(self) -> Iterator[Router]:
        """This router and every included one that owns migrations, each once."""
        seen: set[int] = set()
        stack: list[Router] = [self]
        while stack:
            router = stack.pop(0)
            if id(router) in seen:
                continue
            seen.add(id(router))
            if router.migrations is not None:
                yield router
            stack.extend(router._children)
