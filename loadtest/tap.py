"""The gateway under test with a tap on the stage records it receives: each one as the
gateway's reader thread had it (a Tap in this process, Traces of the others), and the wait
for its calls to end between loads."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench import log


@dataclass(slots=True)
class Seen:
    """A stage record as the gateway received it."""

    recv_ns: int  # when the gateway's reader thread had it
    call_id: str | None
    session: int
    stage: str
    kind: Any  # stages.messages.Kind
    t_ns: int  # the record's stamp: when the stage pushed it
    msg: Any  # None for audio
    cancel_sent_ns: int | None = None
    nbytes: int = 0  # of audio: its PCM16's length


@dataclass
class Tap:
    """Records every stage record the gateway receives, before the gateway handles it.

    Installed as a stage observer of the gateway (Gateway.add_stage_observer, on the ring
    readers' threads) before the app starts; reads the call's `cancels` to pair each
    CANCEL_ACK with the time its CANCEL was sent.
    """

    gateway: Any
    seen: list[Seen] = field(default_factory=list)
    _waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        from stages.messages import Kind

        self._loop = asyncio.get_running_loop()

        def observe(event: Any) -> None:
            call_id, sent = self.gateway.whose(event)
            audio = event.kind is Kind.AUDIO_OUT
            self.seen.append(
                Seen(
                    time.monotonic_ns(),
                    call_id,
                    event.session,
                    event.src,
                    event.kind,
                    event.t_ns,
                    None if audio else event.msg,
                    sent,
                    len(event.msg) if audio else 0,
                )
            )
            if event.kind is Kind.RESPONSE_DONE and event.msg.response_id in self._waiters:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._finished, event.msg.response_id)

        self.gateway.add_stage_observer(observe)

    def _finished(self, response_id: str) -> None:
        waiter = self._waiters.pop(response_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expect_done(self, response_id: str) -> asyncio.Future[None]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[response_id] = waiter
        return waiter

    def mark(self) -> int:
        return len(self.seen)

    def since(self, mark: int) -> list[Seen]:
        return self.seen[mark:]


@dataclass
class Traces:
    """The stage records every gateway process received, read from their traces
    (gateway.trace_dir): what a Tap sees, for gateway processes this one does not run."""

    folder: Path
    by_process: dict[str, int] = field(default_factory=dict)  # records read, last since()

    def mark(self) -> int:
        return time.monotonic_ns()

    def since(self, mark: int) -> list[Seen]:
        from gateway.trace import read_trace
        from stages.messages import Kind

        self.by_process = {}
        seen = [
            Seen(
                e.recv_ns,
                e.call_id,
                e.session,
                e.stage,
                Kind(e.kind),
                e.t_ns,
                e.msg,
                e.cancel_sent_ns,
            )
            for path in sorted(self.folder.glob("*.trace"))
            for e in self._counted(path.stem, read_trace(path, mark))
        ]
        seen.sort(key=lambda x: x.recv_ns)
        return seen

    def _counted(self, process: str, entries: Iterator[Any]) -> Iterator[Any]:
        """`entries`, counted in by_process: which gateway processes the records came from."""
        for entry in entries:
            self.by_process[process] = self.by_process.get(process, 0) + 1
            yield entry


@contextlib.asynccontextmanager
async def tapped_gateway(config: Any, supervisor: Any) -> AsyncIterator[tuple[str, Any, Tap]]:
    """The gateway served on 127.0.0.1 (an ephemeral port) next to running stages, in
    `gateway.processes` processes, with a Tap on this process's stage events; yields (base URL,
    Gateway, Tap). Afterwards the process-wide media settings are restored."""
    from gateway import aiortc_tuning
    from gateway.app import gateway_of
    from gateway.ice import restrict_host_addresses
    from gateway.server import gateway_processes

    taps: list[Tap] = []

    def tap_app(app: Any) -> None:
        taps.append(Tap(gateway_of(app)))
        taps[0].install()

    try:
        async with gateway_processes(config, supervisor, log, on_app=tap_app) as (base, app):
            yield base, gateway_of(app), taps[0]
    finally:
        aiortc_tuning.restore()
        restrict_host_addresses(None)


def open_sessions(gateway: Any) -> int:
    """Sessions open in every gateway process (this one's, or all, read from the shared
    control segment)."""
    if gateway.siblings is None:
        return len(gateway.calls)
    return sum(gateway.siblings.load(g) for g in gateway.names.gateways)


async def calls_gone(gateway: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while open_sessions(gateway) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # polling the gateways' bookkeeping between loads


def phone_session(gateway: Any) -> Any:
    """The in-process gateway's latest phone call (None before one has started)."""
    calls = [c for c in gateway.calls.values() if c.call_id.startswith("tel")]
    return calls[-1] if calls else None


def user_transcripts(session: Any) -> list[str]:
    """A session's caller transcripts so far, in order (a turn still being transcribed is
    not among them)."""
    return [
        item.content[0]["transcript"]
        for item in session.items
        if item.role == "user" and item.content and item.content[0].get("transcript") is not None
    ]
