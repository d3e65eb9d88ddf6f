"""Speech-in end to end on the CPU: the tiny profile whose reasoning model is a tiny random-weight
Qwen2.5-Omni thinker (reasoning.speech_in). The encoder stage runs its audio tower on the
caller's speech as it comes and sends the rows to vLLM, which prefills each window while the
caller speaks; pocketsphinx still transcribes for the client. Over WebRTC (real aiortc peers on
127.0.0.1, real Opus) and over the WebSocket with the official SDK."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from openai import AsyncOpenAI

from gateway.client import RealtimeCall
from gateway.config import load_config
from stages.audio import resample
from stages.config import TINY_OMNI
from tests.gateway.sdk_events import Events, pcm24k_b64

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
ROWS_A_SECOND = 25  # Qwen2.5-Omni's tower
QUESTION = "what is the weather like today in paris and what should I wear tomorrow morning"


@pytest.fixture(scope="module")
def config():
    return load_config(
        TINY,
        {
            "reasoning.model": TINY_OMNI,
            "reasoning.speech_in": {},
            # blocks of 32 positions (the CPU's smallest): a window's rows fill one and more
            "reasoning.engine_args": {
                "enforce_eager": True,
                "block_size": 32,
                "max_model_len": 1024,
                "max_num_seqs": 8,
                "kv_cache_memory_bytes": 128 << 20,
            },
            "reasoning.sampling": {"max_tokens": 160, "ignore_eos": True},
            "gateway.max_output_tokens": 24,
            # the reply made on the rows so far at the caller's pause, as the default profile
            "gateway.turns.prepare_reply_ms": 150,
            "gateway.port": 0,
            "max_sessions": 8,
        },
    )


def usage_of(done: dict) -> dict:
    usage = done["response"]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return usage


async def test_a_spoken_turn_is_heard_as_rows_prefilled_while_spoken(server, make_speech) -> None:
    base, _ = server
    speech = make_speech(QUESTION)
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        call.microphone.play(resample(speech.pcm16, 16000, 48000))
        started = await call.next_event("input_audio_buffer.speech_started", timeout=30)
        stopped = await call.next_event("input_audio_buffer.speech_stopped", timeout=30)
        done = await call.next_event("response.done", timeout=90)
        assert done["response"]["status"] == "completed"
        details = usage_of(done)["input_token_details"]
        seconds = (stopped["audio_end_ms"] - started["audio_start_ms"]) / 1000
        # the turn went in as its rows, every row of the audio the encoder had
        assert details["audio_tokens"] >= ROWS_A_SECOND * (seconds - 1)
        # the windows spoken before the turn ended were prefilled: the reply found them cached
        assert details["cached_tokens"] >= 32
        assert details["cached_tokens_details"]["audio_tokens"] > 0
        # the recognizer still transcribes the turn for the client, off the reply's path: its
        # event may come before or after the reply's
        kind = "conversation.item.input_audio_transcription.completed"
        transcripts = [e for _, e in call.history if e["type"] == kind]
        transcript = transcripts[0] if transcripts else await call.next_event(kind, timeout=30)
        assert transcript["transcript"]
        assert any(frame.any() for frame in call.speaker.frames)  # the reply was heard
    finally:
        await call.close()


async def test_a_barge_in_cancels_the_reply_and_the_turns_prefills(server, make_speech) -> None:
    base, _ = server
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        call.send({"type": "session.update", "session": {"max_output_tokens": 160}})
        call.microphone.play(resample(make_speech(QUESTION).pcm16, 16000, 48000))
        started = await call.next_event("output_audio_buffer.started", timeout=90)
        call.microphone.play(resample(make_speech(QUESTION).pcm16, 16000, 48000))
        cancelled = await call.next_event("omni.response.cancelled", timeout=30)
        assert cancelled["response_id"] == started["response_id"]
        assert cancelled["kv_cache_usage"] == 0.0  # the reply's blocks freed
        # the new turn is heard as rows too, and answered
        done = await call.next_event("response.done", timeout=90)
        while done["response"]["id"] == started["response_id"]:
            done = await call.next_event("response.done", timeout=90)
        assert done["response"]["status"] == "completed"
        assert usage_of(done)["input_token_details"]["audio_tokens"] > 0
    finally:
        await call.close()


async def test_a_websocket_session_speaks_in_too(server, make_speech) -> None:
    base, _ = server
    ws = base.replace("http", "ws")
    client = AsyncOpenAI(api_key="unused", base_url=f"{base}/v1", websocket_base_url=f"{ws}/v1")
    async with client.realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        speech = make_speech(QUESTION).pcm16
        for chunk in pcm24k_b64(np.concatenate([speech, np.zeros(16000, np.int16)])):
            await conn.input_audio_buffer.append(audio=chunk)
            await asyncio.sleep(0.1)  # a caller speaking in real time: windows before the end
        done = await events.next("response.done", timeout=90)
        assert done["response"]["status"] == "completed"
        details = usage_of(done)["input_token_details"]
        assert details["audio_tokens"] > 0 and details["cached_tokens"] >= 32
