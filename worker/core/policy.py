"""The failure policy: where a failed delivery goes, decided in one pure function, ``decide``.
This is the one statement of the policy; every other module points here.

Invariant: every failure path ends. In order:

- PostgreSQL not answering after the failure (whatever the error looked like) pauses
  consumption; the delivery returns to the queue; nothing is parked, no key marked failed.
- The deployment's fault (a table, column, function or privilege missing) does the same.
- A transient failure is tried again in process ``transient_attempts`` times, then sent through
  each delayed-retry queue in turn, then parked as ``retries-exhausted``.
- Any other failure is the message's: parked at once with its ``Rejected`` reason, or as
  ``internal-error``.
- A parked delivery that passed its checks has its key recorded as failed (a later duplicate is
  acked without running), unless its key was reused with another payload (the key belongs to
  the first payload). Only such a parking is the handler's failure, and only those in a row
  throttle the consumer (``Park.paces``): a delivery refused by the worker's own checks (no
  JSON, an invalid body, no handler, too large) or a reused key is the sender's, parked at full
  speed, since pacing could not save it.

Whose fault a failure is, ``errors.classify`` alone says. Nothing here does I/O. The consumer
(``transport.failures``), the in-process retries (``backoff.in_process``) and the test
``Harness`` ask ``decide`` and only carry out its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from worker.core.envelope import Delivery
from worker.errors import Fault, PauseReason, Reason, Rejected, classify

IN_PROCESS_FIRST_DELAY = 0.1
"""Seconds before the second try in process; the wait doubles with each try after it."""

IN_PROCESS_MAX_DELAY = 2.0
"""Longest wait, in seconds, between two tries in process."""


class PolicySource(Protocol):
    """What the policy reads of the worker's settings (``worker.settings.Settings`` has it)."""

    @property
    def transient_attempts(self) -> int: ...

    @property
    def retry_delays(self) -> tuple[float, ...]: ...

    def retry_queue(self, delay: float) -> str: ...


@dataclass(frozen=True)
class RetryQueue:
    """A delayed-retry queue: a copy waits ``delay`` seconds in ``name``, then returns."""

    delay: float
    name: str


@dataclass(frozen=True)
class PolicySettings:
    """The settings the policy decides by: ``transient_attempts`` tries in process, then one
    delayed retry through each of ``retry_queues`` in turn."""

    transient_attempts: int = 1
    retry_queues: tuple[RetryQueue, ...] = ()

    @classmethod
    def of(cls, settings: PolicySource) -> PolicySettings:
        """The policy settings of the worker's ``settings``."""
        return cls(
            transient_attempts=settings.transient_attempts,
            retry_queues=tuple(
                RetryQueue(delay, settings.retry_queue(delay)) for delay in settings.retry_delays
            ),
        )


@dataclass(frozen=True)
class FailureFacts:
    """What is known about a failed delivery besides its exception.

    ``attempt`` is which delivery of the message this is (1, or n + 1 after n delayed retries:
    ``Delivery.attempt``); ``tries`` how many times its unit of work ran in this process, the
    failed one included (0: it failed its checks, so it has no key and touched no database);
    ``database_answers`` whether PostgreSQL answered after the failure: a probe's answer, or
    True for a delivery that failed in a batch whose transaction then committed (None: not
    known yet, see ``asks_database``).
    """

    attempt: int = 1
    tries: int = 1
    database_answers: bool | None = None

    @classmethod
    def of(
        cls,
        delivery: Delivery,
        settings: PolicySettings,
        *,
        opened: bool,
        database_answers: bool | None = None,
    ) -> FailureFacts:
        """The facts of ``delivery`` once its in-process tries ended (``backoff.in_process``
        stops only when ``decide`` no longer says ``RetryInProcess``: for a transient failure,
        after ``transient_attempts`` tries); ``opened`` when it passed its checks."""
        return cls(
            attempt=delivery.attempt,
            tries=settings.transient_attempts if opened else 0,
            database_answers=database_answers,
        )

    @property
    def opened(self) -> bool:
        """True when the delivery passed its checks: it has a key and its unit of work ran."""
        return self.tries > 0


@dataclass(frozen=True)
class RetryInProcess:
    """Run the unit of work again in this process after ``delay`` seconds (plus jitter)."""

    delay: float


@dataclass(frozen=True)
class RetryLater:
    """Send a copy to the delayed-retry ``queue`` (it returns after its delay); ack the delivery."""

    queue: RetryQueue


@dataclass(frozen=True)
class Park:
    """Park a copy in the dead-letter queue with ``reason``; with ``record_key``, record the
    delivery's key as failed so that a later duplicate is acked without running again; with
    ``paces``, the handler failed: it counts toward the dead letters in a row that throttle the
    consumer."""

    reason: Reason
    record_key: bool
    paces: bool

    @property
    def unexpected(self) -> bool:
        """True for a failure nobody anticipated (a bug in the worker): it deserves a traceback."""
        return self.reason is Reason.INTERNAL_ERROR


@dataclass(frozen=True)
class Pause:
    """Not the message's fault: park nothing, return the delivery to the queue and pause
    consumption until ``reason`` is gone."""

    reason: PauseReason


Decision = RetryInProcess | RetryLater | Park | Pause
"""Where a failed delivery goes next: exactly one of these."""


def asks_database(facts: FailureFacts) -> bool:
    """True when PostgreSQL must be probed (``FailureFacts.database_answers``) before the failure
    is blamed on the message: any failure after its checks may be an outage in disguise, unless
    the database is already known to have answered after it (a delivery that failed in a batch
    whose transaction then committed)."""
    return facts.opened and facts.database_answers is None


def in_process_delay(tries: int) -> float:
    """Seconds to wait after ``tries`` failed tries in process: 0.1, 0.2, 0.4, … at most 2."""
    return min(IN_PROCESS_MAX_DELAY, IN_PROCESS_FIRST_DELAY * 2.0 ** (tries - 1))


def decide(exc: BaseException, facts: FailureFacts, settings: PolicySettings) -> Decision:
    """Where the delivery that failed with ``exc`` goes, as the module docstring states."""
    if facts.database_answers is False:
        return Pause(PauseReason.DATABASE_UNREACHABLE)
    fault = classify(exc)
    if fault is Fault.DEPLOYMENT:
        return Pause(PauseReason.DEPLOYMENT)
    if fault is Fault.TRANSIENT:
        if 0 < facts.tries < settings.transient_attempts:
            return RetryInProcess(in_process_delay(facts.tries))
        if facts.attempt <= len(settings.retry_queues):
            return RetryLater(settings.retry_queues[facts.attempt - 1])
        reason = Reason.RETRIES_EXHAUSTED
    else:
        reason = exc.reason if isinstance(exc, Rejected) else Reason.INTERNAL_ERROR
    handlers = handlers_failure(reason, opened=facts.opened)
    return Park(reason, record_key=handlers, paces=handlers)


def handlers_failure(reason: Reason, *, opened: bool) -> bool:
    """True when a delivery that failed for ``reason`` failed in its handler: it passed its
    checks (``opened``) and its key was not reused. Only such a failure records its key as
    failed, and only such dead letters in a row throttle the consumer."""
    return opened and reason is not Reason.KEY_REUSED
