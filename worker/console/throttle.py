"""Who a console request comes from, and how many failed logins each source may still make.

Invariant: failed logins are counted per client address, per network (an IPv6 /64, an IPv4
/24) and over the whole console, each in a sliding ``LOGIN_WINDOW``. An address that has made
its own budget of failures is refused (429) without its token being looked at; every other
login is tried. The budget of an address is ``LOGIN_ATTEMPTS``, and one failure
(``STRAINED_ATTEMPTS``) while its network's or the console's budget is spent: a guesser that
rotates addresses gets one guess per address and window, while an address that has not failed
(the operator's) is always tried, so no spent shared budget locks a right token out. A right
token clears its address's failures. Memory stays bounded: ``MAX_TRACKED`` sources, each
keeping no more timestamps than its budget.

The client address is the peer's, unless the peer is one of ``console_trusted_proxies``: then
it is the last address of ``X-Forwarded-For`` that is not one of them (what the nearest proxy
saw), so one proxy's users are not throttled as one address, and a client cannot name itself
past a proxy that appends what it saw.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

from starlette.types import Scope

from worker.ingress.edge import client_address

LOGIN_ATTEMPTS = 10
"""Failed logins an address may make per ``LOGIN_WINDOW``; more are answered 429."""
STRAINED_ATTEMPTS = 1
"""An address's budget while its network's or the console's is spent."""
NETWORK_ATTEMPTS = 30
"""Failed logins per ``LOGIN_WINDOW`` from one /64 (IPv6) or /24 (IPv4) before it is strained."""
GLOBAL_ATTEMPTS = 100
"""Failed logins per ``LOGIN_WINDOW`` from anywhere before every address is strained."""
LOGIN_WINDOW = 60.0
MAX_TRACKED = 4096
"""Addresses (and networks) whose failed logins are remembered at most (the oldest forgotten)."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Failures:
    """Timestamps of failures by source, each within ``LOGIN_WINDOW`` and at most ``keep``."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._by_source: OrderedDict[str, deque[float]] = OrderedDict()

    def count(self, source: str, now: float) -> int:
        kept = self._by_source.get(source)
        if kept is None:
            return 0
        while kept and now - kept[0] >= LOGIN_WINDOW:
            kept.popleft()
        if not kept:
            del self._by_source[source]
            return 0
        return len(kept)

    def add(self, source: str, now: float) -> None:
        kept = self._by_source.setdefault(source, deque(maxlen=self.keep))
        kept.append(now)
        self._by_source.move_to_end(source)
        while len(self._by_source) > MAX_TRACKED:
            self._by_source.popitem(last=False)

    def clear(self, source: str) -> None:
        self._by_source.pop(source, None)


class LoginThrottle:
    """The console's failed-login budgets (see the module's invariant)."""

    def __init__(self) -> None:
        self._addresses = Failures(LOGIN_ATTEMPTS)
        self._networks = Failures(NETWORK_ATTEMPTS)
        self._everyone = Failures(GLOBAL_ATTEMPTS)

    def allowed(self, address: str) -> bool:
        """Whether a login from ``address`` is tried (else it is answered 429)."""
        now = time.monotonic()
        strained = (
            self._networks.count(network_of(address), now) >= NETWORK_ATTEMPTS
            or self._everyone.count("", now) >= GLOBAL_ATTEMPTS
        )
        budget = STRAINED_ATTEMPTS if strained else LOGIN_ATTEMPTS
        return self._addresses.count(address, now) < budget

    def failed(self, address: str) -> None:
        """Count one failed login of ``address``."""
        now = time.monotonic()
        self._addresses.add(address, now)
        self._networks.add(network_of(address), now)
        self._everyone.add("", now)

    def succeeded(self, address: str) -> None:
        """A right token from ``address``: its own failures are forgotten."""
        self._addresses.clear(address)


def network_of(address: str) -> str:
    """The network an address is counted in: its /64 (IPv6) or /24 (IPv4); a name that is no
    address is its own network."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    prefix = 64 if parsed.version == 6 else 24
    return str(ipaddress.ip_network(f"{parsed}/{prefix}", strict=False))


class ClientAddress:
    """The client address of a request, through ``trusted`` proxies (see the module's
    docstring); a callable on an ASGI scope."""

    def __init__(self, trusted: Sequence[str]) -> None:
        self.trusted: tuple[Network, ...] = tuple(ipaddress.ip_network(each) for each in trusted)

    def __call__(self, scope: Scope) -> str:
        peer = client_address(scope)
        if not self.trusted or not self._is_trusted(peer):
            return peer
        forwarded = [
            part.strip()
            for name, value in scope.get("headers", [])
            if name == b"x-forwarded-for"
            for part in value.decode("latin-1").split(",")
        ]
        for hop in reversed(forwarded):
            if not self._is_trusted(hop):
                return _address(hop) or peer
        return peer

    def _is_trusted(self, address: str) -> bool:
        parsed = _address(address)
        return parsed is not None and any(
            ipaddress.ip_address(parsed) in network for network in self.trusted
        )


def _address(text: str) -> str | None:
    """``text`` as an IP address's canonical text, None if it is none."""
    try:
        return str(ipaddress.ip_address(text.strip().strip("[]")))
    except ValueError:
        return None
