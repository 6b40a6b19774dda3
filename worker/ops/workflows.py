"""Resuming a workflow by hand (``worker workflows resume``): one whose owner died and that no
message is left to resume.

Invariant: a workflow is resumed only when no live run owns it and it does not wait for a
deadline still to come; then, in one transaction, its dead owner is released and a copy of its
resume message (the one its waits stored, naming its last wait) goes to the outbox. That copy
runs it like any resume: its committed steps replay, a due wait times out, and it never starts
the workflow over (a resume that finds no key is dropped). A second copy changes nothing: the
first one's run carries the workflow, and the copy is dropped or finds it completed.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from worker.core.signals import RESUME_HEADER
from worker.errors import WorkerError
from worker.sql import outbox, owners, waits


class NotResumable(WorkerError):
    """The workflow cannot be resumed by hand: it is not in progress, or something moves it."""


@dataclass(frozen=True)
class Resumed:
    """A workflow resumed by hand: its resume message's id and the wait it names, or None for
    both when it never waited (then only its dead owner was released: publish its starting
    message again, with its key, to resume it)."""

    handler: str
    key: str
    message_id: str | None
    wait: str | None


def resume_command(handler: str, key: str) -> str:
    """The command line that resumes the workflow, its handler and key quoted for a shell."""
    return f"worker workflows resume {shlex.quote(handler)} {shlex.quote(key)}"


async def resume(engine: AsyncEngine, handler: str, key: str, *, notify: bool = True) -> Resumed:
    """Release the workflow's dead owner and put its resume message in the outbox; raises
    ``NotResumable`` for a key not in progress, one a live run owns, or one that waits for a
    deadline still to come (its signal or its timer resumes it)."""
    async with engine.begin() as conn:
        state = await owners.owner_state(conn, handler, key)
        if state is None:
            raise NotResumable(f"no inbox key {key!r} of handler {handler!r}")
        if state.status != "in_progress":
            raise NotResumable(f"workflow {key!r} of {handler!r} is {state.status}")
        if state.alive:
            raise NotResumable(
                f"workflow {key!r} of {handler!r} is run by a live owner ({state.owner}): "
                "it carries the workflow on"
            )
        wait = await waits.last_wait(conn, handler, key)
        if wait is not None and wait.outcome is None and not wait.due:
            raise NotResumable(
                f"workflow {key!r} of {handler!r} waits ({wait.name}) for a deadline still to "
                "come: its signal or its timer resumes it"
            )
        await owners.release_dead(conn, handler, key)
        if wait is None:
            return Resumed(handler, key, None, None)
        message = dataclasses.replace(
            wait.resume, headers={**wait.resume.headers, RESUME_HEADER: wait.name}
        )
        await outbox.append_outbox(conn, [message], notify=notify)
    return Resumed(handler, key, str(message.message_id), wait.name)
