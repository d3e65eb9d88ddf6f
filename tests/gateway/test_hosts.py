"""Which gateway host a new call or a hang-up goes to, and the signature a forwarded request
must carry (gateway.hosts); the whole path on a real cluster: test_gateway_hosts.py."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.config import load_config
from gateway.hosts import (
    CLIENT_ADDRESS,
    FORWARDED_HOST,
    SIGNATURE,
    SIGNATURE_SKEW_S,
    SIGNED_AT,
    STALE_S,
    ClusterMember,
    HostLoad,
    HostTable,
    signature,
    verify,
)
from gateway.siblings import call_id, gateway_of_call, host_of_call
from tests.serving import serving_gateway_alone

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"

SECRET = b"s" * 32


def member(host: int = 0) -> ClusterMember:
    return ClusterMember(host, "127.0.0.1", SECRET, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "i0")


def load(host: int, free: int, ready: bool = True) -> HostLoad:
    return HostLoad(host, f"http://127.0.0.{host + 1}:8080", free, 4, ready, "i")


def test_call_ids_name_their_host_and_process() -> None:
    assert host_of_call(call_id("rtc", 2, host=5)) == 5
    assert gateway_of_call(call_id("rtc", 2, host=5)) == 2
    assert host_of_call(call_id("rtc", 2)) is None  # outside a cluster
    assert gateway_of_call(call_id("rtc", 2)) == 2


def test_a_new_call_goes_to_a_ready_host_with_more_room_and_stale_hosts_are_forgotten() -> None:
    now = [100.0]
    table = HostTable(member(0), clock=lambda: now[0])
    table.heard(load(0, 9))  # its own, as the exchange echoes it: not a target
    table.heard(load(1, 3))
    table.heard(load(2, 1))
    table.heard(load(3, 8, ready=False))  # its stages are down
    assert table.targets_for_new_call(free_here=3) == []  # equal room: kept here
    assert [h.host for h in table.targets_for_new_call(free_here=0)] in ([1, 2], [2, 1])
    assert {h.host for h in table.targets_for_new_call(free_here=2)} == {1}
    seen = {table.targets_for_new_call(free_here=0)[0].host for _ in range(200)}
    assert seen == {1, 2}  # the first drawn from the two best: no herd on one host
    now[0] += STALE_S + 0.1
    table.heard(load(2, 1))
    assert [h.host for h in table.hosts()] == [2]  # 1 and 3 not heard from
    assert table.host(1) is None and table.host(2) == load(2, 1)


def forwarded(body: bytes, client: str, signed_at: float, secret: bytes = SECRET) -> web.Request:
    stamp = repr(signed_at)
    headers = {
        CLIENT_ADDRESS: client,
        SIGNED_AT: stamp,
        SIGNATURE: signature(secret, "POST", "/v1/realtime/calls", stamp, client, body),
    }
    return make_mocked_request("POST", "/v1/realtime/calls", headers=headers)


def test_only_a_request_signed_with_the_clusters_secret_vouches_for_its_caller() -> None:
    now = time.time()
    assert verify(SECRET, forwarded(b"v=0", "10.1.2.3", now), b"v=0") == "10.1.2.3"
    with pytest.raises(PermissionError, match="signature does not match"):
        verify(SECRET, forwarded(b"v=0", "10.1.2.3", now, secret=b"x" * 32), b"v=0")
    with pytest.raises(PermissionError, match="signature does not match"):
        verify(SECRET, forwarded(b"v=0", "10.1.2.3", now), b"v=1")  # another body
    with pytest.raises(PermissionError, match="signed 60 s away"):
        verify(SECRET, forwarded(b"", "10.1.2.3", now - 2 * SIGNATURE_SKEW_S), b"")
    unsigned = make_mocked_request("POST", "/v1/realtime/calls", headers={CLIENT_ADDRESS: "x"})
    with pytest.raises(PermissionError, match="needs X-Omni-Forward-Time"):
        verify(SECRET, unsigned, b"")


def test_client_secrets_are_signed_alike_on_every_host() -> None:
    assert member(0).client_secret_key == member(3).client_secret_key
    other = ClusterMember(0, "127.0.0.1", b"t" * 32, "", "", "i0")
    assert other.client_secret_key != member(0).client_secret_key


def signed_headers(body: bytes, secret: bytes) -> dict[str, str]:
    stamp = repr(time.time())
    return {
        "Content-Type": "application/sdp",
        FORWARDED_HOST: "1",
        CLIENT_ADDRESS: "10.1.2.3",
        SIGNED_AT: stamp,
        SIGNATURE: signature(secret, "POST", "/v1/realtime/calls", stamp, "10.1.2.3", body),
    }


@pytest.mark.timeout(60)
async def test_a_gateway_takes_forwarded_calls_only_signed_and_only_in_a_cluster() -> None:
    config = load_config(TINY, {"gateway.media.gc_freeze": False})
    body = b"v=0 not an offer"
    async with (
        serving_gateway_alone(config) as (alone, _),
        serving_gateway_alone(config, member=member(0)) as (in_cluster, _),
        aiohttp.ClientSession() as http,
    ):
        calls = f"{alone}/v1/realtime/calls"
        async with http.post(calls, data=body, headers=signed_headers(body, SECRET)) as r:
            assert r.status == 403 and "in no cluster" in (await r.json())["error"]["message"]
        calls = f"{in_cluster}/v1/realtime/calls"
        forged = signed_headers(body, b"x" * 32)
        async with http.post(calls, data=body, headers=forged) as r:
            assert r.status == 403 and "does not match" in (await r.json())["error"]["message"]
        # signed: past the check, to the offer itself (which is no SDP)
        async with http.post(calls, data=body, headers=signed_headers(body, SECRET)) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_sdp"
