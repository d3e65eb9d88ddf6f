"""The other gateway processes of one service (`gateway.processes` > 1), and how a request
reaches the process it belongs to.

Every gateway process listens on the public port (SO_REUSEPORT: the kernel deals connections
out among them) and on a private Unix socket. A request that belongs to another process goes
there over its socket, once (a forwarded request is never forwarded again):
- a new call goes to the process with the fewest sessions, so calls spread evenly and
  admission counts the whole service, not the process the kernel happened to pick;
- a hang-up goes to the process holding the call, which its id names (`rtc_g1_...`).
After signaling, a WebRTC call's media flows straight to its process. A WebSocket session stays
on the process that accepted it.
"""

from __future__ import annotations

import logging
import re
import secrets
from pathlib import Path

import aiohttp
from aiohttp import web

from shm import Control
from stages.rings import RingNames

logger = logging.getLogger(__name__)

FORWARDED = "X-Omni-Forwarded-By"
CLIENT_ADDRESS = "X-Omni-Client-Address"  # set by the sibling that forwards
VOUCHED = web.RequestKey("vouched_client", str)  # the client address another host signed
_CALL_TAG = re.compile(r"^[a-z]+_(?:h(\d+))?g(\d+)_")
# what a forwarded request needs from the caller's headers, and its answer from the sibling's
REQUEST_HEADERS = ("Authorization", "Content-Type")
_RESPONSE_HEADERS = ("Content-Type", "Location", "Retry-After")


def call_id(prefix: str, gateway_index: int, host: int | None = None) -> str:
    """A new call id that names the gateway process holding the call, and in a cluster its
    host (gateway.hosts)."""
    on_host = "" if host is None else f"h{host}"
    return f"{prefix}_{on_host}g{gateway_index}_{secrets.token_hex(8)}"


def gateway_of_call(call_id: str) -> int | None:
    """The index of the gateway process a call id names, or None for an id it did not make."""
    match = _CALL_TAG.match(call_id)
    return int(match.group(2)) if match else None


def host_of_call(call_id: str) -> int | None:
    """The gateway host a call id names (None: made outside a cluster, or not by us)."""
    match = _CALL_TAG.match(call_id)
    return int(match.group(1)) if match and match.group(1) is not None else None


def socket_path(socket_dir: str | Path, instance: str) -> Path:
    """Where gateway process `instance` takes forwarded requests."""
    return Path(socket_dir) / f"{instance}.sock"


def client_address(request: web.Request) -> str | None:
    """The caller's address: the socket's peer, or for a request a sibling forwarded over
    its Unix socket, the address that sibling saw (a TCP peer cannot claim one), or for a
    request another host forwarded, the one its signature vouches for (gateway.hosts)."""
    if VOUCHED in request:
        return request[VOUCHED] or None
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peer, tuple):  # (host, port, ...): TCP
        return str(peer[0])
    return request.headers.get(CLIENT_ADDRESS) if FORWARDED in request.headers else None


async def pass_on(
    client: aiohttp.ClientSession,
    request: web.Request,
    url: str,
    body: bytes,
    headers: dict[str, str],
    unreachable: str,
) -> web.Response:
    """`request` sent on to `url` with `body` and `headers`; the answer as is, or a 503 with
    Retry-After saying `unreachable` when nothing answers there."""
    try:
        async with client.request(
            request.method,
            url,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            payload = await resp.read()
            out = {h: resp.headers[h] for h in _RESPONSE_HEADERS if h in resp.headers}
            return web.Response(status=resp.status, body=payload, headers=out)
    except (aiohttp.ClientError, TimeoutError) as exc:
        logger.warning("forwarding %s to %s failed: %s", request.path, url, exc)
        error = {"message": unreachable, "type": "server_error", "code": "unavailable"}
        return web.json_response(
            {"error": error | {"param": None}}, status=503, headers={"Retry-After": "1"}
        )


class Siblings:
    """What one gateway process knows of all of them: their loads, read from the shared
    control segment (gateway k holds the session ids k, k + n, ...), and their sockets."""

    def __init__(
        self, names: RingNames, instance: str, control: Control, socket_dir: str | Path
    ) -> None:
        self.names = names
        self.instance = instance
        self.control = control
        self.socket_dir = Path(socket_dir)
        self._clients: dict[str, aiohttp.ClientSession] = {}

    def load(self, instance: str) -> int:
        """Sessions gateway process `instance` holds now."""
        ids = self.names.sessions_of(instance, self.control.max_sessions)
        return sum(1 for s in ids if self.control.holder(s))

    def target_for_new_call(self, request: web.Request) -> str | None:
        """The sibling a new call should go to (strictly fewer sessions than here), or None
        to take it here."""
        if FORWARDED in request.headers:
            return None
        here = self.load(self.instance)
        others = [(self.load(g), g) for g in self.names.gateways if g != self.instance]
        if not others:
            return None
        load, instance = min(others)
        return instance if load < here else None

    def holder_of_call(self, call_id: str, request: web.Request) -> str | None:
        """The sibling holding `call_id`, or None when it is this process's (or unknown, or
        the request was already forwarded once)."""
        index = gateway_of_call(call_id)
        if FORWARDED in request.headers or index is None or index >= len(self.names.gateways):
            return None
        instance = self.names.gateways[index]
        return None if instance == self.instance else instance

    async def forward(self, request: web.Request, instance: str) -> web.Response:
        """Pass `request` (its body unread) to sibling `instance`; its answer is returned as
        is. A sibling that cannot be reached (restarting) gets a 503 with Retry-After."""
        body = await request.read()
        headers = {h: request.headers[h] for h in REQUEST_HEADERS if h in request.headers}
        headers[FORWARDED] = self.instance
        if client := client_address(request):
            headers[CLIENT_ADDRESS] = client
        client = self._clients.get(instance)
        if client is None:
            connector = aiohttp.UnixConnector(path=str(socket_path(self.socket_dir, instance)))
            client = self._clients[instance] = aiohttp.ClientSession(connector=connector)
        return await pass_on(
            client,
            request,
            f"http://{instance}{request.rel_url}",
            body,
            headers,
            "the gateway process holding this request is restarting",
        )

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
