"""ICE sockets read every datagram they have queued when the event loop wakes them.

asyncio's selector loop reads one datagram per wake-up of a UDP socket. Each call's ICE socket
receives 50 or more packets a second, so once one turn of a busy loop takes about 20 ms the
socket's queue only grows: media and STUN wait behind it (consent checks go unanswered for
most of a second at 10 calls on 2 cores, and RFC 7675 drops every call after 30 s). The sockets
of aioice's STUN protocol (every ICE host candidate) read up to `udp_reads_per_wake` queued
datagrams a wake-up instead, as libuv does (32). Retire this once asyncio's datagram transport
drains its socket on a wake-up.
"""

from __future__ import annotations

import asyncio.selector_events as _selector_events
from collections.abc import Callable
from typing import Any

import aioice.ice as _aioice

from gateway.aiortc_tuning.common import code_names, fail, settings

DatagramTransport: Any = _selector_events._SelectorDatagramTransport
STOCK: Callable[[Any], None] = DatagramTransport._read_ready


def _read_ready_drained(self: Any) -> None:
    """asyncio's `_SelectorDatagramTransport._read_ready`, reading up to `udp_reads_per_wake`
    queued datagrams instead of one; transports of other protocols keep the stock read."""
    if not isinstance(self._protocol, _aioice.StunProtocol):
        STOCK(self)
        return
    for _ in range(settings.udp_reads_per_wake):
        if self._conn_lost:
            return
        try:
            data, addr = self._sock.recvfrom(self.max_size)
        except (BlockingIOError, InterruptedError):
            return  # drained
        except OSError as exc:
            self._protocol.error_received(exc)
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, "Fatal read error on datagram transport")
            return
        self._protocol.datagram_received(data, addr)


def verify() -> None:
    """asyncio's datagram read, and the protocol aioice reads its sockets with."""
    if not isinstance(getattr(_aioice, "StunProtocol", None), type):
        raise fail("aioice.ice.StunProtocol is missing")
    missing = sorted(
        {"_conn_lost", "_sock", "recvfrom", "max_size", "_protocol", "datagram_received"}
        - code_names(STOCK)
    )
    if missing:
        raise fail(f"asyncio's datagram transport no longer reads with {missing}")


def install() -> None:
    DatagramTransport._read_ready = _read_ready_drained


def remove() -> None:
    DatagramTransport._read_ready = STOCK
