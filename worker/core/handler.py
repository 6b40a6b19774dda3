"""A registered handler: the record that names an effect in the inbox and says how its body is
validated. A leaf module: the router registers handlers, the envelope carries one, and neither
needs the other to know what a handler is.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError

from worker.errors import InvalidBody


class HandlerKind(enum.Enum):
    """How a handler runs, which decides its unit of work."""

    PLAIN = "plain"
    """``func(body, ctx)``, once per message, in the batch's one transaction."""

    BATCH = "batch"
    """``func(bodies, batch)``, once for all of a batch's messages of its routing key, in the
    batch's one transaction."""

    WORKFLOW = "workflow"
    """``func(body, wf)``, each step in a transaction of its own, alone, resumable."""


@dataclass(frozen=True)
class Handler:
    """A registered handler. ``name`` and the idempotency key identify an effect in the inbox."""

    name: str
    routing_key: str
    func: Callable[[Any, Any], Awaitable[Any]]
    body_type: Any
    kind: HandlerKind = HandlerKind.PLAIN
    publishes: tuple[tuple[str, Any], ...] = ()
    """(routing key, body type) of the events it declares it publishes: documentation (the
    AsyncAPI document), not a check of what ``ctx.publish`` is given."""
    declares_signal: Callable[[str], bool] | None = field(default=None, repr=False, compare=False)
    """For a workflow: whether a routing key is a declared signal (its router's, looked up when
    ``wf.wait_for`` names one); None: not checked."""
    adapter: TypeAdapter[Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapter", TypeAdapter(self.body_type))

    def validate(self, value: Any) -> Any:
        """``value`` (decoded JSON) validated into the handler's body type, or ``InvalidBody``."""
        try:
            return self.adapter.validate_python(value)
        except ValidationError as exc:
            errors = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<body>'}: {err['msg']}"
                for err in exc.errors(include_url=False)
            )
            raise InvalidBody(f"body failed validation: {errors}") from exc


class Handlers(Protocol):
    """Where a delivery's handler is looked up by routing key (a ``Router``)."""

    def find(self, routing_key: str) -> Handler | None: ...
