"""The talker voice end to end on the CPU: a WebRTC call (real aiortc peers on 127.0.0.1, real
Opus) to the tiny profile whose vocoder is a random-weight talker served by vLLM in the vocoder
stage, speaking SNAC codes that the real SNAC decoder (random weights of snac_24khz's shape)
turns into audio. A turn is heard; a barge-in stops it, and the vocoder's acknowledgement comes
once the talker's request is aborted and its KV blocks are free."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from gateway.app import gateway_of
from gateway.client import RealtimeCall
from gateway.config import load_config
from stages.audio import resample
from stages.config import RANDOM_SNAC, TINY_TALKER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
SILENT_RMS = 30.0  # Opus silence decodes to a few LSBs


@pytest.fixture(scope="module")
def config():
    return load_config(
        TINY,
        {
            "reasoning.sampling": {"max_tokens": 120, "ignore_eos": True},
            "gateway.port": 0,
            "max_sessions": 8,
            "vocoder.backend": "talker",
            "vocoder.model": TINY_TALKER,
            "vocoder.vocoder": RANDOM_SNAC,
            "vocoder.batch": 16,
            "vocoder.options": {
                "max_frames_per_char": 0.8,  # random weights: nothing else ends a phrase
                "engine_args": {"kv_cache_memory_bytes": 128 << 20, "max_model_len": 1024},
            },
        },
    )


def speech48k(recording) -> np.ndarray:
    pcm = recording.pcm16
    start = int(np.argmax(np.abs(pcm) > 500))
    return resample(pcm[start:], 16000, 48000)


async def test_a_turn_is_spoken_by_the_talker_and_a_barge_in_frees_its_kv(
    server, make_speech
) -> None:
    base, app = server
    gateway = gateway_of(app)
    call = await RealtimeCall.connect(base)
    try:
        created = await call.next_event("session.created")
        assert created["session"]["audio"]["output"]["format"]["rate"] == 24000
        call.microphone.play(speech48k(make_speech("what is the weather like today in paris")))
        await call.next_event("input_audio_buffer.speech_stopped", timeout=20)
        started = await call.next_event("output_audio_buffer.started", timeout=60)
        rid = started["response_id"]

        # the agent speaks: voiced audio reaches the caller
        heard_from = len(call.speaker.levels)
        deadline = time.monotonic() + 30
        while sum(lvl > SILENT_RMS for lvl in call.speaker.levels[heard_from:]) < 25:
            assert time.monotonic() < deadline, "no half second of the agent's voice in 30 s"
            await asyncio.sleep(0.05)  # frames arrive on the call's own track task
        session = gateway.calls[call.call_id]
        assert session.transport.playout.rate == 24000

        # ... until the caller talks over it
        call.microphone.play(speech48k(make_speech("stop please I have another question")))
        cancelled = await call.next_event("omni.response.cancelled", timeout=20)
        assert cancelled["response_id"] == rid
        assert set(cancelled["stages_ms"]) == {"encoder", "reasoning", "vocoder"}
        # both engines report the cancelled reply's blocks freed, the talker's too
        assert cancelled["kv_cache_usage_by_stage"] == {"reasoning": 0.0, "vocoder": 0.0}
        assert cancelled["kv_cache_usage"] == 0.0
        print(
            f"\ncancel acked by every stage in {cancelled['cancel_latency_ms']} ms: "
            f"{cancelled['stages_ms']}"
        )

        # the next turn is answered by the talker too: its voice reaches the caller
        started = await call.next_event("output_audio_buffer.started", timeout=90)
        while started["response_id"] == rid:
            started = await call.next_event("output_audio_buffer.started", timeout=90)
        heard_from = len(call.speaker.levels)
        deadline = time.monotonic() + 30
        while sum(lvl > SILENT_RMS for lvl in call.speaker.levels[heard_from:]) < 25:
            assert time.monotonic() < deadline, "the next reply's voice did not come"
            await asyncio.sleep(0.05)  # frames arrive on the call's own track task
        heard = np.concatenate(call.speaker.frames[heard_from:]).astype(np.float64)
        assert np.sqrt(np.mean(heard**2)) > 100, "the talker's audio did not reach the caller"
    finally:
        await call.close()
