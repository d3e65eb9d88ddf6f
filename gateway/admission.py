"""Who may open one more call: bounds per API key, per client secret and per client address
on the calls held at once, and per address on the rate of new ones and of failed keys
(gateway.limits), so that one client cannot take the slots every other caller shares, nor
try keys at speed. The process-wide bound (gateway.max_calls) is the Gateway's own."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.auth import Grant
from gateway.config import LimitsConfig

ADDRESSES_KEPT = 10_000  # recent addresses whose new-call times are remembered
WINDOW_S = 60.0


class TooManyCalls(RuntimeError):
    """This client holds, or has opened, as many calls as it may; `retry_after_s`: when
    asking again may succeed."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Holder:
    """What one call counts against."""

    key: str | None  # Grant.holder: a key's or a secret's digest; None with auth off
    ephemeral: bool
    address: str | None


class Admission:
    def __init__(self, limits: LimitsConfig, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._held: dict[str, Holder] = {}  # call id -> what it counts against
        self._by_key: collections.Counter[str] = collections.Counter()
        self._by_address: collections.Counter[str] = collections.Counter()
        self._opened = _Window(clock)
        self._auth_failed = _Window(clock)

    def check(self, grant: Grant, address: str | None) -> Holder:
        """The holder a new call of `grant` from `address` counts against; raises
        TooManyCalls past a limit."""
        limits, holder = self.limits, Holder(grant.holder, grant.ephemeral, address)
        what, field = ("client secret", "client_secret") if grant.ephemeral else ("API key", "key")
        key_limit = getattr(limits, f"calls_per_{field}")
        if (
            holder.key is not None
            and key_limit is not None
            and self._by_key[holder.key] >= key_limit
        ):
            raise TooManyCalls(
                f"this {what} holds {key_limit} calls, its limit "
                f"(gateway.limits.calls_per_{field})",
                retry_after_s=5,
            )
        if address is None:
            return holder
        if (limit := limits.calls_per_address) is not None and self._by_address[address] >= limit:
            raise TooManyCalls(
                f"{address} holds {limit} calls, its limit (gateway.limits.calls_per_address)",
                retry_after_s=5,
            )
        if (rate := limits.new_calls_per_address_per_minute) is not None and (
            wait := self._opened.full(address, rate)
        ):
            raise TooManyCalls(
                f"{address} opened {rate} calls in the last minute, its limit "
                "(gateway.limits.new_calls_per_address_per_minute)",
                retry_after_s=wait,
            )
        return holder

    def admit(self, call_id: str, holder: Holder) -> None:
        """The call is open: it counts until `release`."""
        self._held[call_id] = holder
        if holder.key is not None:
            self._by_key[holder.key] += 1
        if holder.address is not None:
            self._by_address[holder.address] += 1
            if self.limits.new_calls_per_address_per_minute is not None:
                self._opened.add(holder.address)

    def release(self, call_id: str) -> None:
        holder = self._held.pop(call_id, None)
        if holder is None:
            return
        for counter, name in ((self._by_key, holder.key), (self._by_address, holder.address)):
            if name is not None:
                counter[name] -= 1
                if counter[name] <= 0:
                    del counter[name]

    def auth_failed(self, address: str | None) -> None:
        """`address` presented a wrong or missing key."""
        if address is not None and self.limits.auth_failures_per_address_per_minute is not None:
            self._auth_failed.add(address)

    def check_auth_rate(self, address: str | None) -> None:
        """Raises TooManyCalls while `address` is past its failed keys of the minute."""
        rate = self.limits.auth_failures_per_address_per_minute
        if (
            address is not None
            and rate is not None
            and (wait := self._auth_failed.full(address, rate))
        ):
            raise TooManyCalls(
                f"{address} presented {rate} wrong or missing keys in the last minute "
                "(gateway.limits.auth_failures_per_address_per_minute)",
                retry_after_s=wait,
            )


class _Window:
    """Times of events per address over the last minute, for the most recent addresses."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._times: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )

    def add(self, address: str) -> None:
        times = self._times.pop(address, None) or collections.deque()
        times.append(self.clock())
        self._times[address] = times  # the most recent last
        while len(self._times) > ADDRESSES_KEPT:
            self._times.popitem(last=False)

    def full(self, address: str, limit: int) -> int:
        """0 while `address` has had fewer than `limit` events this minute; else the seconds
        until the oldest leaves it."""
        times = self._times.get(address)
        if times is None:
            return 0
        now = self.clock()
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        if len(times) < limit:
            return 0
        return max(1, int(times[0] + WINDOW_S - now) + 1)
