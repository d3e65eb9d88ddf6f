"""gateway.auth's token for /metrics, from the gateway served on 127.0.0.1 on rings no stage
reads (API keys and client secrets: tests/gateway/test_realtime_sdk.py)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from gateway.auth import ScrapeAuth
from gateway.config import load_config
from tests.serving import serving_gateway_alone

pytestmark = pytest.mark.timeout(60)

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
KEY = "sk-auth-test"
TOKEN = "scrape-token-for-the-test"
TOKEN_ENV = "OMNI_TEST_METRICS_TOKEN"


def config(**metrics: str | None):
    return load_config(
        TINY,
        {
            "gateway.auth": {"api_keys": [KEY], "api_keys_env": None},
            "gateway.metrics": metrics,
            "gateway.media.gc_freeze": False,
        },
    )


def test_a_named_token_that_is_not_set_stops_the_start() -> None:
    with pytest.raises(ValueError, match=f"{TOKEN_ENV}, which is not set"):
        ScrapeAuth(config(token_env=TOKEN_ENV).gateway.metrics, environ={})
    with pytest.raises(ValueError, match="not set"):
        ScrapeAuth(config(token_env=TOKEN_ENV).gateway.metrics, environ={TOKEN_ENV: "  "})


async def test_metrics_need_the_token_when_one_is_set(monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with (
        serving_gateway_alone(config(token_env=TOKEN_ENV)) as (base, _),
        aiohttp.ClientSession() as http,
    ):
        for headers, code in [
            ({}, "missing_api_key"),
            ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
            ({"Authorization": f"Bearer {KEY}"}, "invalid_api_key"),  # an API key is no token
        ]:
            async with http.get(f"{base}/metrics", headers=headers) as r:
                assert r.status == 401
                error = (await r.json())["error"]
                assert error["code"] == code and TOKEN not in error["message"]
        async with http.get(f"{base}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and "omni_sessions" in await r.text()
        # the token opens nothing else
        token = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(f"{base}/v1/realtime/client_secrets", headers=token) as r:
            assert r.status == 401


async def test_metrics_are_open_by_default() -> None:
    async with (
        serving_gateway_alone(config()) as (base, _),
        aiohttp.ClientSession() as http,
        http.get(f"{base}/metrics") as r,
    ):
        assert r.status == 200 and "omni_sessions" in await r.text()
