"""Time to first audio byte against whole synthesis time for POST /v1/audio/speech.

Starts the stages of a configuration (default: configs/tiny.yaml, espeak-ng) and the
gateway on 127.0.0.1, then asks for the same texts streamed and unstreamed, side by side:

    python -m loadtest.speech_bench [--config configs/tiny.yaml] [--repeat 5]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.app import build_app
from gateway.config import load_config
from gateway.media import prepare_media
from gateway.server import vocoder_rate
from stages.supervisor import Supervisor

TEXTS = {
    "short (1 sentence)": "Hello there, how can I help you today?",
    "medium (4 sentences)": (
        "The weather today is mild. There is a light wind from the west. "
        "Rain is expected in the evening. Take an umbrella if you go out."
    ),
    "long (12 sentences)": " ".join(
        ["The quick brown fox jumps over the lazy dog, and then it runs away."] * 12
    ),
}


async def one(http: aiohttp.ClientSession, base: str, voice: str, text: str, stream: bool) -> dict:
    t0 = time.perf_counter()
    first = None
    size = 0
    async with http.post(
        f"{base}/v1/audio/speech",
        json={"model": "tts", "input": text, "voice": voice, "stream": stream},
    ) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_any():
            if first is None and chunk:
                first = time.perf_counter() - t0
            size += len(chunk)
    total = time.perf_counter() - t0
    return {"ttfb_ms": first * 1000, "total_ms": total * 1000, "audio_s": size / 2 / 24000}


async def run(config_path: Path, repeat: int) -> dict:
    config = load_config(config_path, {"gateway.auth": {"enabled": False}, "gateway.port": 0})
    voice = config.vocoder.voice
    with Supervisor(config) as supervisor:
        supervisor.start()
        prepare_media(config)
        runner = web.AppRunner(
            build_app(
                config, supervisor.names, vocoder_rate(supervisor), lambda: supervisor.healthy
            )
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        base = f"http://{host}:{port}"
        rows = []
        try:
            async with aiohttp.ClientSession() as http:
                await one(http, base, voice, "warm up", True)
                for name, text in TEXTS.items():
                    for stream in (True, False):
                        runs = [await one(http, base, voice, text, stream) for _ in range(repeat)]
                        rows.append(
                            {
                                "text": name,
                                "stream": stream,
                                "audio_s": round(runs[0]["audio_s"], 2),
                                "ttfb_ms_p50": round(
                                    statistics.median(r["ttfb_ms"] for r in runs), 1
                                ),
                                "total_ms_p50": round(
                                    statistics.median(r["total_ms"] for r in runs), 1
                                ),
                            }
                        )
        finally:
            await runner.cleanup()
    return {
        "benchmark": "speech_ttfb",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "vocoder": config.vocoder.backend,
        "repeat": repeat,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/tiny.yaml"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    result = asyncio.run(run(args.config, args.repeat))
    print(f"{'text':22} {'stream':6} {'audio s':>8} {'first byte ms':>14} {'total ms':>9}")
    for r in result["rows"]:
        print(
            f"{r['text']:22} {'yes' if r['stream'] else 'no':6} {r['audio_s']:8.2f} "
            f"{r['ttfb_ms_p50']:14.1f} {r['total_ms_p50']:9.1f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
