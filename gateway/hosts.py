"""The other gateway hosts of a cluster, and how a call's signaling reaches the host that will
carry it (docs/scaling.md, "Routing and admission").

Each gateway host of a cluster runs a whole pipeline (its gateway processes, its stages, its
control segment), so a call lives on one host from its offer to its hang-up. The hosts tell
each other their loads through the load exchange (`gateway.load_exchange`, on the driver's
host): every host's first gateway process publishes a `HostLoad` when it changes (looked at
every 50 ms) and every second regardless; every gateway process subscribes and keeps the
latest of each host, forgetting one not heard from for `STALE_S`.

A new call goes to the ready host with the most free slots, drawn at random from the two best
(a burst read from one table does not herd onto one host), this host preferred at equal: its
signaling is forwarded over HTTP to that host's public address, signed with the cluster's
secret, and that host's own admission decides. A refusal (503) makes the forwarder try the
other one once, then take the call here or refuse it. A call's id names its host
(`rtc_h1g0_...`), so a hang-up sent to any host reaches the one holding the call.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from gateway.siblings import CLIENT_ADDRESS, REQUEST_HEADERS, pass_on

logger = logging.getLogger(__name__)

FORWARDED_HOST = "X-Omni-Forwarded-Host"  # the index of the host that forwarded the request
SIGNATURE = "X-Omni-Forward-Signature"
SIGNED_AT = "X-Omni-Forward-Time"
#: a signed request older (or newer) than this is refused: the hosts' clocks are NTP's
SIGNATURE_SKEW_S = 30.0
PUBLISH_EVERY_S = 1.0  # a host's load, changed or not
LOOK_EVERY_S = 0.05  # how often a host's load is looked at for a change
STALE_S = 3.0  # a host not heard from for this long is out of the table


class HostLoad(msgspec.Struct, frozen=True):
    """One gateway host's load, as the exchange carries it."""

    host: int
    url: str  # where the others forward its calls' signaling
    free: int  # calls it would still take
    capacity: int  # gateway.max_calls
    ready: bool  # its stages are all up
    incarnation: str  # new each time the host starts


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(HostLoad).decode


@dataclass(frozen=True)
class ClusterMember:
    """What a gateway process of a cluster knows of its host's place in it."""

    host: int  # this host's index; 0 is the driver's
    address: str  # where the other hosts reach this one
    secret: bytes  # the cluster's: signs forwarded requests and client secrets
    publish: str  # the exchange's endpoint that publishers connect to
    subscribe: str  # ... and subscribers
    incarnation: str

    @property
    def client_secret_key(self) -> bytes:
        """The key client secrets (`ek_`) are signed with, the same on every host: one minted
        by any host is good at all of them."""
        return hmac.new(self.secret, b"client secrets", hashlib.sha256).digest()


def signature(
    secret: bytes, method: str, path: str, signed_at: str, client: str, body: bytes
) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = "\n".join((method, path, signed_at, client, digest)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(secret: bytes, request: web.Request, body: bytes) -> str | None:
    """The client address a request forwarded by another host vouches for; PermissionError
    naming what is wrong when its signature does not hold."""
    signed_at = request.headers.get(SIGNED_AT, "")
    given = request.headers.get(SIGNATURE, "")
    client = request.headers.get(CLIENT_ADDRESS, "")
    try:
        skew = abs(time.time() - float(signed_at))
    except ValueError:
        raise PermissionError(f"a forwarded request needs {SIGNED_AT}") from None
    if skew > SIGNATURE_SKEW_S:
        raise PermissionError(f"a forwarded request signed {skew:.0f} s away from now")
    wanted = signature(secret, request.method, request.path_qs, signed_at, client, body)
    if not hmac.compare_digest(given, wanted):
        raise PermissionError("a forwarded request whose signature does not match")
    return client or None


class HostTable:
    """The latest load of every other host, as the exchange brings them (one gateway
    process's copy)."""

    def __init__(self, member: ClusterMember, clock: Callable[[], float] = time.monotonic) -> None:
        self.member = member
        self.clock = clock
        self._loads: dict[int, tuple[HostLoad, float]] = {}

    def heard(self, load: HostLoad) -> None:
        if load.host != self.member.host:
            self._loads[load.host] = (load, self.clock())

    def hosts(self) -> list[HostLoad]:
        """The other hosts heard from within STALE_S."""
        now = self.clock()
        return [load for load, at in self._loads.values() if now - at <= STALE_S]

    def host(self, index: int) -> HostLoad | None:
        return next((h for h in self.hosts() if h.host == index), None)

    def targets_for_new_call(self, free_here: int) -> list[HostLoad]:
        """Hosts to offer a new call to before taking it here, best first: ready ones with
        more free slots than this host, the first drawn from the two best."""
        better = sorted(
            (h for h in self.hosts() if h.ready and h.free > free_here),
            key=lambda h: h.free,
            reverse=True,
        )[:2]
        random.shuffle(better)
        return better


class HostRouter:
    """One gateway process's part in the cluster: the table it subscribes to, the load it
    publishes (its host's first process only), and forwarding to other hosts."""

    def __init__(
        self,
        member: ClusterMember,
        load_here: Callable[[], HostLoad | None],
        publishes: bool,
    ) -> None:
        self.member = member
        self.table = HostTable(member)
        self.load_here = load_here  # None until the host has a public address
        self.publishes = publishes
        self._client: aiohttp.ClientSession | None = None

    # -- the exchange --------------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe (and publish) until cancelled."""
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.member.subscribe)
        tasks = [asyncio.create_task(self._listen(sub), name="host-table")]
        pub = None
        if self.publishes:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(self.member.publish)
            tasks.append(asyncio.create_task(self._publish(pub), name="host-load"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sub.close()
            if pub is not None:
                pub.close()

    async def _listen(self, sub) -> None:
        while True:
            frame = await sub.recv()
            try:
                self.table.heard(_decode(frame))
            except msgspec.DecodeError as exc:
                logger.warning("a load the exchange carried could not be read: %s", exc)

    async def _publish(self, pub) -> None:
        last: HostLoad | None = None
        sent_at = 0.0
        while True:
            load = self.load_here()
            now = time.monotonic()
            if load is not None and (load != last or now - sent_at >= PUBLISH_EVERY_S):
                await pub.send(_encode(load))
                last, sent_at = load, now
            await asyncio.sleep(LOOK_EVERY_S)

    # -- forwarding ----------------------------------------------------------------------

    def forwarded(self, request: web.Request) -> bool:
        return FORWARDED_HOST in request.headers

    async def forward(
        self, request: web.Request, host: HostLoad, client: str | None
    ) -> web.Response:
        """Pass `request` to `host`, signed; its answer as is. One that cannot be reached
        answers 503 with Retry-After."""
        body = await request.read()
        signed_at = repr(time.time())
        headers = {h: request.headers[h] for h in REQUEST_HEADERS if h in request.headers}
        headers |= {
            FORWARDED_HOST: str(self.member.host),
            CLIENT_ADDRESS: client or "",
            SIGNED_AT: signed_at,
            SIGNATURE: signature(
                self.member.secret, request.method, request.path_qs, signed_at, client or "", body
            ),
        }
        if self._client is None:
            self._client = aiohttp.ClientSession()
        return await pass_on(
            self._client,
            request,
            f"{host.url}{request.path_qs}",
            body,
            headers,
            f"gateway host {host.host} did not answer",
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
