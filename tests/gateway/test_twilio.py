"""Phone calls: the Twilio Media Streams endpoint, with a client written from Twilio's message
formats (loadtest.phone) sending real μ-law speech (espeak-ng through FFmpeg's G.711 coder),
and G.711 as a Realtime WebSocket format. The tiny profile's real stages (pocketsphinx, vLLM
on the tiny model, espeak-ng) behind the gateway, API keys on."""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import aiohttp
import numpy as np
import pytest

from gateway.app import gateway_of
from loadtest.phone import FRAME, PhoneCall, mulaw_decode, mulaw_encode
from stages.audio import resample
from tests.serving import tiny_call_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

KEY = "sk-omni-phone-key"


@pytest.fixture(scope="module")
def config():
    return tiny_call_config(
        {
            # replies of a few seconds, heard to their end
            "gateway.max_output_tokens": 24,
            "gateway.auth": {"enabled": True, "api_keys": [KEY], "api_keys_env": None},
            "gateway.telephony": {
                "profiles": {
                    "default": {"instructions": "You answer the phone for a bakery."},
                    "quiet": {"output_modalities": ["text"]},
                    # long replies, so that there is something to talk over
                    "long": {"max_output_tokens": 120},
                }
            },
        }
    )


def phone_url(base: str) -> str:
    return base.replace("http", "ws") + "/v1/telephony/twilio"


def speech8k(make_speech, text: str) -> np.ndarray:
    return resample(make_speech(text).pcm16, 16000, 8000)


async def test_a_phone_call_is_answered_in_speech(server, make_speech) -> None:
    base, app = server
    async with PhoneCall.dial(phone_url(base), {"api_key": KEY}) as phone:
        phone.say(speech8k(make_speech, "what time does the bakery open"))
        spoke = await phone.until_agent_speaks()
        said = await phone.until_said(1)
        assert spoke > said[1], "the agent spoke before the caller had finished"
        # the session the phone call is: the caller's turn in it, with the profile's settings
        [call] = [c for c in gateway_of(app).calls.values() if c.call_id.startswith("tel")]
        assert call.config.instructions == "You answer the phone for a bakery."
        user = [i for i in call.items if i.role == "user"]
        assert user and user[0].content[0]["transcript"]
        await phone.until_silent()
        # marks came back for the audio played: the reply was heard to its end
        assert any(name.startswith("done.") for name in phone.marks_echoed)
        assert call.reply is None


async def test_a_barge_in_on_the_phone_clears_the_agent(server, make_speech) -> None:
    base, app = server
    async with PhoneCall.dial(phone_url(base), {"api_key": KEY, "profile": "long"}) as phone:
        phone.say(speech8k(make_speech, "tell me about your bread"))
        spoke = await phone.until_agent_speaks()
        [call] = [c for c in gateway_of(app).calls.values() if c.call_id.startswith("tel")]
        await asyncio.sleep(1.0)  # the agent is a second into its reply
        reply = call.reply
        assert reply is not None and reply.item is not None
        phone.say(speech8k(make_speech, "stop please"))
        async with asyncio.timeout(10):
            while not phone.clears:
                await asyncio.sleep(0.01)
        assert phone.clears[0] - phone.onsets[1] < 1.0, "clear came late"
        await phone.until_said(2)
        await asyncio.sleep(0.3)
        # the agent's media stopped: nothing of the cut reply is played after the clear, up to
        # when the caller's own turn could be answered (the VAD's silence window after it)
        quiet_until = phone.said[1][1] + 0.3
        assert not [t for t in phone.voiced_at if phone.clears[0] + 0.05 < t < quiet_until]
        # the conversation holds what the caller heard of it, by Twilio's marks
        assert reply.state.value == "cut"
        heard = reply.item.content[0]["transcript"]
        assert len(heard) < len(reply.text), (heard, reply.text)
        assert spoke < phone.clears[0]


async def test_a_hang_up_ends_the_session_in_every_stage(server, make_speech) -> None:
    base, app = server
    gateway = gateway_of(app)
    async with PhoneCall.dial(phone_url(base), {"api_key": KEY}) as phone:
        phone.say(speech8k(make_speech, "what cakes do you have"))
        await phone.until_agent_speaks()
        [call] = [c for c in gateway.calls.values() if c.call_id.startswith("tel")]
        assert call.reply is not None  # hung up while the reply is being made
        await phone.hang_up()
        await asyncio.wait_for(call.closed.wait(), 10)
    assert call.close_reason == "hung up (stop)"
    assert call.call_id not in gateway.calls
    # the vLLM request of the reply was aborted: another call's cancel finds no KV in use
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        # omni_events in a base URL that a client appended its ?model= to, as pipecat does
        http.ws_connect(base.replace("http", "ws") + "/v1/realtime?omni_events=on?model=x") as ws,
    ):
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi"}],
        }
        await ws.send_json({"type": "conversation.item.create", "item": item})
        await ws.send_json({"type": "response.create"})
        async with asyncio.timeout(60):
            async for msg in ws:
                event = json.loads(msg.data)
                if event["type"] == "response.output_audio_transcript.delta":
                    await ws.send_json({"type": "response.cancel"})
                if event["type"] == "omni.response.cancelled":
                    assert event["kv_cache_usage"] == 0.0
                    break


async def test_bad_frames_are_dropped_and_the_call_goes_on(server, make_speech, caplog) -> None:
    base, _ = server
    caplog.set_level(logging.WARNING, logger="gateway.twilio")
    async with PhoneCall.dial(phone_url(base), {"api_key": KEY}) as phone:
        bad_media = {"event": "media", "streamSid": phone.stream_sid}
        for frame in (
            "not json",
            json.dumps({"no": "event"}),
            json.dumps({**bad_media, "media": {"payload": "%%%not base64%%%"}}),
            json.dumps(
                {**bad_media, "media": {"payload": base64.b64encode(b"\xff" * 40000).decode()}}
            ),
            json.dumps({**bad_media, "media": {}}),
            json.dumps({"event": "rewind", "streamSid": phone.stream_sid}),
            json.dumps({"event": "mark", "streamSid": phone.stream_sid, "mark": {}}),
        ):
            await phone.send_raw(frame)
        await phone.ws.send_bytes(b"\x00\x01")
        phone.say(speech8k(make_speech, "are you open on sunday"))
        await phone.until_agent_speaks()
    dropped = [r.getMessage() for r in caplog.records if "bad frame" in r.getMessage()]
    assert len(dropped) >= 5, dropped
    assert any("not base64" in m for m in dropped) and any("40000 bytes" in m for m in dropped)


async def test_streams_are_refused_before_any_audio_without_a_key_or_profile(server) -> None:
    base, app = server
    gateway = gateway_of(app)
    before = len(gateway.calls)
    for parameters, why in (
        ({}, "no API key"),
        ({"api_key": "sk-wrong"}, "incorrect API key"),
        ({"api_key": KEY, "profile": "night"}, "no profile 'night'"),
    ):
        async with PhoneCall.dial(phone_url(base), parameters) as phone:
            async with asyncio.timeout(10):
                while phone.closed is None:
                    await asyncio.sleep(0.01)
        assert phone.closed[0] == 1008 and why in phone.closed[1], phone.closed
        assert len(gateway.calls) == before  # no session was ever opened


async def test_g711_over_the_realtime_websocket(server, make_speech) -> None:
    """audio/pcmu in and out of a Realtime session: μ-law 8 kHz appends are heard, and the
    reply comes back as μ-law 8 kHz."""
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    speech = mulaw_encode(speech8k(make_speech, "what is the weather today"))
    silence = b"\xff" * 8000
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        # omni_events in a base URL that a client appended its ?model= to, as pipecat does
        http.ws_connect(base.replace("http", "ws") + "/v1/realtime?omni_events=on?model=x") as ws,
    ):
        fmt = {"type": "audio/pcmu"}
        audio = {"input": {"format": fmt}, "output": {"format": fmt}}
        # seconds of reply show the format; the module's long replies are for talking over
        session = {"type": "realtime", "audio": audio, "max_output_tokens": 24}
        await ws.send_json({"type": "session.update", "session": session})
        deltas: list[bytes] = []
        async with asyncio.timeout(60):
            async for msg in ws:
                event = json.loads(msg.data)
                assert event["type"] != "error", event
                if event["type"] == "session.updated":
                    assert event["session"]["audio"]["output"]["format"] == {
                        "type": "audio/pcmu",
                        "rate": 8000,
                    }
                    for i in range(0, len(speech + silence), FRAME):
                        chunk = (speech + silence)[i : i + FRAME]
                        b64 = base64.b64encode(chunk).decode()
                        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64})
                        await asyncio.sleep(0.02)
                if event["type"] == "response.output_audio.delta":
                    deltas.append(base64.b64decode(event["delta"]))
                if event["type"] == "response.done":
                    break
    pcm = mulaw_decode(b"".join(deltas))
    assert len(pcm) > 8000 and np.abs(pcm).max() > 1000  # seconds of 8 kHz speech
