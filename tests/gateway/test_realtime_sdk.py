"""OpenAI Realtime conformance, driven by the official `openai` SDK over the WebSocket API,
against the real gateway and stages (pocketsphinx, vLLM on the tiny model, espeak-ng), with
API keys on. Also the HTTP side: client secrets, /v1/audio/speech, auth failures. (One module
over 500 lines: every test shares one served pipeline, which takes half a minute to start.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import opuslib
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from openai import AsyncOpenAI

from gateway.client import Microphone, RealtimeCall, typed_event
from loadtest.tools_bench import WEATHER
from tests.gateway.sdk_events import Events, decode_audio, pcm24k_b64, text_turn
from tests.serving import tiny_call_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

KEY = "sk-omni-test-key"


@pytest.fixture(scope="module")
def config():
    return tiny_call_config(
        {
            "gateway.max_output_tokens": 24,
            "gateway.auth": {"enabled": True, "api_keys": [KEY], "api_keys_env": None},
        }
    )


@pytest.fixture(scope="module")
def base(server) -> str:
    return server[0]


def sdk(base: str, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(
        api_key=key, base_url=f"{base}/v1", websocket_base_url=base.replace("http", "ws") + "/v1"
    )


async def test_session_update_applies_and_refuses_what_is_not_built(base) -> None:
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        created = await events.next("session.created")
        assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        assert created["session"]["max_output_tokens"] == 24  # gateway.max_output_tokens
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "Answer in three words.",
                "audio": {
                    "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}
                },
            }
        )
        updated = (await events.next("session.updated"))["session"]
        assert updated["instructions"] == "Answer in three words."
        assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 400

        # one of OpenAI's voices is taken, and the vocoder's speaks it, which session.updated says
        await conn.session.update(
            session={"type": "realtime", "audio": {"output": {"voice": "alloy"}}}
        )
        spoken = (await events.next("session.updated"))["session"]
        assert spoken["audio"]["output"]["voice"] == "en-us"
        await conn.session.update(
            session={"type": "realtime", "audio": {"output": {"voice": "robot"}}},
            event_id="evt_voice",
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_voice" and "voice" in error["param"]
        assert "en-us" in error["message"]  # names what this gateway speaks instead
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": {"threshold": 7}}}},
            event_id="evt_threshold",
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_threshold" and "threshold" in error["param"]
        # instructions the model's context cannot hold beside a reply: refused when set,
        # naming the limit, instead of every reply failing
        await conn.session.update(
            session={"type": "realtime", "instructions": "Speak kindly. " * 2000},
            event_id="evt_long",
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_long" and error["code"] == "context_length_exceeded"
        assert error["param"] == "session.instructions" and "holds 1024" in error["message"]
        # a refused update changed nothing
        await conn.session.update(session={"type": "realtime"})
        again = (await events.next("session.updated"))["session"]
        assert again["audio"]["output"]["voice"] == "en-us"
        assert again["instructions"] == "Answer in three words."
        assert again["audio"]["input"]["turn_detection"]["threshold"] == 0.5


def pcm16k_b64(pcm16k: np.ndarray, chunk_ms: int = 100) -> list[str]:
    step, pcm = 16 * chunk_ms, pcm16k.astype("<i2")
    pieces = (pcm[i : i + step] for i in range(0, len(pcm), step))
    return [base64.b64encode(piece.tobytes()).decode() for piece in pieces]


@pytest.mark.parametrize("rate", [24000, 16000])
async def test_spoken_turn(base, make_speech, rate) -> None:
    """OpenAI's 24 kHz PCM, and 16 kHz (NVIDIA's Full-Duplex-Bench client asks for it)."""
    speech = make_speech("what is the weather like today in paris")
    chunks = pcm24k_b64 if rate == 24000 else pcm16k_b64
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        if rate != 24000:
            pcm = {"type": "audio/pcm", "rate": rate}
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": {"format": pcm}}}
            )
            shown = (await events.next("session.updated"))["session"]
            assert shown["audio"]["input"]["format"] == pcm
        for chunk in chunks(speech.pcm16):
            await conn.input_audio_buffer.append(audio=chunk)
        silence = np.zeros(16000, np.int16)  # end of turn for the VAD
        for chunk in chunks(silence):
            await conn.input_audio_buffer.append(audio=chunk)
        started = await events.next("input_audio_buffer.speech_started")
        stopped = await events.next("input_audio_buffer.speech_stopped")
        assert stopped["audio_end_ms"] > started["audio_start_ms"]
        committed = await events.next("input_audio_buffer.committed")
        user_item = committed["item_id"]
        done = await events.next("response.done", timeout=60)
        assert done["response"]["status"] == "completed"
        # the transcript and the reply reach the gateway on different rings: `completed` may
        # come before or after response.created (OpenAI's transcription is asynchronous too)
        first = {}
        for event in events.seen:
            first.setdefault(event["type"], event)
        transcript = first["conversation.item.input_audio_transcription.completed"]
        assert transcript["item_id"] == user_item and transcript["transcript"]
        rid = first["response.created"]["response"]["id"]
        assert first["response.output_audio.delta"]["response_id"] == rid
        assert done["response"]["id"] == rid
        order = events.types()
        assert (
            order.index("response.created")
            < order.index("response.output_item.added")
            < order.index("response.output_audio.delta")
        )
        deltas = [e for e in events.seen if e["type"] == "response.output_audio.delta"]
        audio = decode_audio(deltas)
        assert len(audio) / 24000 > 0.5 and np.sqrt(np.mean(audio.astype(float) ** 2)) > 300
        said = "".join(
            e["delta"] for e in events.seen if e["type"] == "response.output_audio_transcript.delta"
        )
        item = done["response"]["output"][0]
        assert item["role"] == "assistant" and item["content"][0]["transcript"] == said
        order = events.types()
        assert order.index("response.output_audio.done") < order.index("response.done")
        await events.next("rate_limits.updated")


async def test_speaking_again_before_the_reply_starts_stops_it_unheard(base, make_speech) -> None:
    """The caller's first turn ends and they speak again at once, before its transcript is
    back: the reply to the first turn is stopped as it starts (a cancel would purge the turn
    they are in), the caller hears none of it, and the turn they went on with is answered."""
    first = make_speech("what is the weather like today in paris")
    second = make_speech("and what about tomorrow in london")
    # espeak's recordings have 0.5 s of silence at each end: 1 s between the two ends the
    # first turn; the second is cut where its voice ends, so the caller is still speaking
    voiced = np.flatnonzero(np.abs(second.pcm16.astype(np.int32)) > 1000)
    speaking = np.concatenate([first.pcm16, second.pcm16[: voiced[-1] + 1]])
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        # appended faster than real time: the second turn starts long before the first's
        # transcript can come back from the encoder
        for chunk in pcm24k_b64(speaking):
            await conn.input_audio_buffer.append(audio=chunk)
        await events.next("input_audio_buffer.speech_stopped")
        await events.next("input_audio_buffer.speech_started")
        created = await events.next("response.created", timeout=60)
        stopped = await events.next("response.done")
        assert stopped["response"]["id"] == created["response"]["id"]
        assert stopped["response"]["status"] == "cancelled"
        assert stopped["response"]["status_details"]["reason"] == "turn_detected"

        for chunk in pcm24k_b64(np.zeros(16000, np.int16)):  # the second turn ends
            await conn.input_audio_buffer.append(audio=chunk)
        answered = await events.next("response.done", timeout=60)
        assert answered["response"]["status"] == "completed"
        audio = [e for e in events.seen if e["type"] == "response.output_audio.delta"]
        assert audio, "the reply to the second turn was not heard"
        assert {e["response_id"] for e in audio} == {answered["response"]["id"]}
        assert events.types().count("input_audio_buffer.committed") == 2


async def test_text_turn_with_text_and_with_audio_output(base) -> None:
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        await text_turn(conn, events, "tell me a joke", output_modalities=["text"])
        done = await events.next("response.done", timeout=60)
        assert done["response"]["status"] == "completed"
        text = "".join(e["delta"] for e in events.seen if e["type"] == "response.output_text.delta")
        assert text and done["response"]["output"][0]["content"][0] == {
            "type": "output_text",
            "text": text,
        }
        assert "response.output_audio.delta" not in events.types()

        await text_turn(conn, events, "and another one")
        await events.next("response.output_audio.delta")
        done = await events.next("response.done", timeout=60)
        assert done["response"]["output_modalities"] == ["audio"]


async def test_cancel_mid_response_frees_the_kv_cache(base) -> None:
    # omni_events: the gateway's own omni.response.cancelled, which says the KV cache is free
    on = {"omni_events": "on"}
    async with sdk(base).realtime.connect(model="gpt-realtime", extra_query=on) as conn:
        events = Events(conn)
        await events.next("session.created")
        # a long text reply, so that the cancel lands while vLLM is still generating it
        await text_turn(
            conn, events, "talk for a long time", output_modalities=["text"], max_output_tokens=900
        )
        await events.next("response.output_text.delta")
        await conn.response.cancel()
        done = await events.next("response.done")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["output"][0]["status"] == "incomplete"
        acked = await events.next("omni.response.cancelled")
        assert acked["response_id"] == done["response"]["id"]
        assert set(acked["stages_ms"]) == {"encoder", "reasoning", "vocoder"}
        assert acked["kv_cache_usage"] == 0.0  # the aborted request's KV blocks are free
        # cancelling again is refused, naming why
        await conn.response.cancel(event_id="evt_again")
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_again" and error["code"] == "response_cancel_not_active"


async def test_truncate_cuts_the_item_to_what_was_heard(base) -> None:
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        await text_turn(conn, events, "say something")
        done = await events.next("response.done", timeout=60)
        item = done["response"]["output"][0]
        full = item["content"][0]["transcript"]
        deltas = [e for e in events.seen if e["type"] == "response.output_audio.delta"]
        length_ms = len(decode_audio(deltas)) * 1000 // 24000
        assert length_ms > 1000 and len(full.split()) >= 2

        await conn.conversation.item.truncate(
            item_id=item["id"], content_index=0, audio_end_ms=length_ms + 5000, event_id="evt_far"
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_far" and error["param"] == "audio_end_ms"

        await conn.conversation.item.truncate(
            item_id=item["id"], content_index=0, audio_end_ms=length_ms // 3
        )
        truncated = await events.next("conversation.item.truncated")
        assert truncated["item_id"] == item["id"] and truncated["audio_end_ms"] == length_ms // 3
        await conn.conversation.item.retrieve(item_id=item["id"])
        kept = (await events.next("conversation.item.retrieved"))["item"]["content"][0]
        # a prefix of what was said (random weights write words without spaces, which
        # phrases cut inside a word: the prefix may end inside one)
        assert full.startswith(kept["transcript"]) and len(kept["transcript"]) < len(full)

        await conn.conversation.item.delete(item_id=item["id"])
        assert (await events.next("conversation.item.deleted"))["item_id"] == item["id"]
        await conn.conversation.item.retrieve(item_id=item["id"], event_id="evt_gone")
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_gone" and error["code"] == "not_found"


async def test_bad_input_gets_errors_and_the_session_goes_on(base) -> None:
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        await conn.input_audio_buffer.append(audio="this is not base64!", event_id="evt_b64")
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_b64" and error["code"] == "invalid_audio"
        await conn.input_audio_buffer.append(
            audio=base64.b64encode(b"abc").decode(), event_id="evt_odd"
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_odd" and "odd" in error["message"]
        await conn.send({"type": "no.such.event", "event_id": "evt_unknown"})
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_unknown" and error["code"] == "unknown_event"
        await conn.send(
            {
                "type": "response.create",
                "event_id": "evt_tools",
                "response": {"tools": [{"type": "function", "name": "a function"}]},
            }
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_tools" and error["param"] == "response.tools[0].name"
        # the connection survived all of it
        await text_turn(conn, events, "are you still there", output_modalities=["text"])
        assert (await events.next("response.done", timeout=60))["response"]["status"] == "completed"


async def test_manual_turns_commit_and_respond(base, make_speech) -> None:
    speech = make_speech("please turn on the lights")
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        assert (await events.next("session.updated"))["session"]["audio"]["input"][
            "turn_detection"
        ] is None
        await conn.input_audio_buffer.commit(event_id="evt_empty")
        error = (await events.next("error"))["error"]
        assert (
            error["event_id"] == "evt_empty" and error["code"] == "input_audio_buffer_commit_empty"
        )
        for chunk in pcm24k_b64(speech.pcm16):
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        committed = await events.next("input_audio_buffer.committed")
        # response.create right away: the gateway holds it until the turn is transcribed
        await conn.response.create(response={"output_modalities": ["text"]})
        transcript = await events.next("conversation.item.input_audio_transcription.completed")
        assert transcript["item_id"] == committed["item_id"] and transcript["transcript"]
        done = await events.next("response.done", timeout=60)
        assert done["response"]["status"] == "completed"
        assert "input_audio_buffer.speech_started" not in events.types()


async def test_keys_client_secrets_and_their_sessions(base, make_speech) -> None:
    with pytest.raises(Exception, match="401"):
        async with sdk(base, key="sk-wrong").realtime.connect(model="gpt-realtime") as conn:
            await conn.recv()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/realtime/client_secrets", json={}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "missing_api_key"
        async with http.post(
            f"{base}/v1/realtime/client_secrets",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"session": {"type": "realtime", "audio": {"output": {"speed": "fast"}}}},
        ) as resp:
            assert resp.status == 400 and "speed" in (await resp.json())["error"]["param"]
    async with sdk(base) as client:
        secret = await client.realtime.client_secrets.create(
            expires_after={"anchor": "created_at", "seconds": 60},
            session={"type": "realtime", "instructions": "You are a pirate."},
        )
    assert secret.value.startswith("ek_") and secret.expires_at > time.time() + 50
    async with sdk(base, key=secret.value).realtime.connect(model="gpt-realtime") as conn:
        created = (await Events(conn).next("session.created"))["session"]
        assert created["instructions"] == "You are a pirate."
    # a browser's WebSocket cannot set headers: the key rides in a subprotocol
    ws_url = base.replace("http", "ws") + "/v1/realtime?model=x"
    async with aiohttp.ClientSession() as http:
        protocols = ("realtime", f"openai-insecure-api-key.{secret.value}")
        async with http.ws_connect(ws_url, protocols=protocols) as ws:
            assert ws.protocol == "realtime"
            assert (await ws.receive_json())["type"] == "session.created"
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await http.ws_connect(ws_url, protocols=("realtime", "openai-insecure-api-key.bad"))
        assert err.value.status == 401
    # the secret opens WebRTC calls too (here with the Python client), but cannot mint more
    call = await RealtimeCall.connect(base, api_key=secret.value)
    try:
        created = typed_event(await call.next_event("session.created"))
        assert created.session.instructions == "You are a pirate."
        assert call.send_file(str(make_speech("good morning").path)) > 1.0
        started = typed_event(await call.next_event("input_audio_buffer.speech_started"))
        assert started.type == "input_audio_buffer.speech_started" and started.item_id
    finally:
        await call.close()
    async with sdk(base, key=secret.value) as client:
        with pytest.raises(Exception, match="401"):
            await client.realtime.client_secrets.create()
    with pytest.raises(ConnectionError, match="401"):
        await RealtimeCall.connect(base, api_key="ek_forged")


async def test_speech_endpoint_streams_before_synthesis_ends(base) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 40
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        t0 = time.monotonic()
        async with http.post(
            f"{base}/v1/audio/speech",
            json={"model": "tts", "input": text, "voice": "en-us", "response_format": "pcm"},
        ) as resp:
            assert resp.status == 200 and resp.content_type == "audio/pcm"
            first = await resp.content.readany()
            t_first = time.monotonic() - t0
            rest = await resp.read()
            t_all = time.monotonic() - t0
        pcm = np.frombuffer(first + rest, dtype="<i2")
        assert len(pcm) / 24000 > 5 and np.sqrt(np.mean(pcm.astype(float) ** 2)) > 300
        assert t_first < t_all / 2, (t_first, t_all)

        async with http.post(
            f"{base}/v1/audio/speech",
            json={
                "model": "tts",
                "input": "hello",
                "voice": "en-us",
                "response_format": "wav",
                "stream": False,
            },
        ) as resp:
            body = await resp.read()
        with wave.open(io.BytesIO(body)) as wav:
            assert wav.getframerate() == 24000 and wav.getnframes() > 2400

        async with http.post(
            f"{base}/v1/audio/speech",
            json={"model": "tts", "input": "hello", "voice": "alloy"},
        ) as resp:
            assert resp.status == 400
            assert "voice" in (await resp.json())["error"]["param"]


async def test_opus_over_the_websocket(base, make_speech) -> None:
    """The audio/opus extension: one 20 ms Opus packet per append and per delta, coded and
    decoded here with opuslib; a corrupt packet is refused and the session goes on."""
    speech = make_speech("what time is it in london")
    pcm = np.concatenate([speech.pcm16, np.zeros(16000, np.int16)])  # 16 kHz, then silence
    encoder = opuslib.Encoder(16000, 1, opuslib.APPLICATION_VOIP)
    packets = [
        encoder.encode(pcm[i : i + 320].tobytes(), 320) for i in range(0, len(pcm) - 319, 320)
    ]
    async with sdk(base).realtime.connect(model="gpt-realtime") as conn:
        events = Events(conn)
        await events.next("session.created")
        opus = {"type": "audio/opus"}
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"format": opus}, "output": {"format": opus}},
            }
        )
        formats = (await events.next("session.updated"))["session"]["audio"]
        assert (
            formats["input"]["format"]["type"]
            == formats["output"]["format"]["type"]
            == "audio/opus"
        )
        await conn.input_audio_buffer.append(
            audio=base64.b64encode(b"\xff\xfe\x00garbage").decode(), event_id="evt_corrupt"
        )
        error = (await events.next("error"))["error"]
        assert error["event_id"] == "evt_corrupt" and error["code"] == "invalid_audio"
        sent = 0
        for packet in packets:
            b64 = base64.b64encode(packet).decode()
            sent += len(b64)
            await conn.input_audio_buffer.append(audio=b64)
        transcript = await events.next("conversation.item.input_audio_transcription.completed")
        assert transcript["transcript"]
        done = await events.next("response.done", timeout=60)
        assert done["response"]["status"] == "completed"
    deltas = [e["delta"] for e in events.seen if e["type"] == "response.output_audio.delta"]
    decoder = opuslib.Decoder(24000, 1)
    frames = [decoder.decode(base64.b64decode(d), 480) for d in deltas]
    assert all(len(f) == 960 for f in frames)  # 480 samples: one 20 ms packet each
    heard = np.frombuffer(b"".join(frames), dtype=np.int16).astype(float)
    assert np.sqrt(np.mean(heard**2)) > 300
    # base64 characters on the wire against PCM16 24 kHz's for the same audio
    pcm_in = len(packets) * 0.02 * 24000 * 2 * 4 / 3
    pcm_out = len(deltas) * 0.02 * 24000 * 2 * 4 / 3
    received = sum(len(d) for d in deltas)
    print(
        f"\naudio/opus vs audio/pcm on the wire: in {sent / pcm_in:.3f}, "
        f"out {received / pcm_out:.3f}"
        f" ({8 * sent / (len(packets) * 0.02) / 1000:.1f} and "
        f"{8 * received / (len(deltas) * 0.02) / 1000:.1f} kbit/s of base64)"
    )
    assert sent < 0.2 * pcm_in and received < 0.2 * pcm_out


async def test_sdk_webrtc_call_with_its_session(base) -> None:
    """client.realtime.calls.create: a multipart offer carrying the session configuration."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    channel = pc.createDataChannel("oai-events")
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    channel.on("message", lambda message: events.put_nowait(json.loads(message)))
    pc.addTrack(Microphone())
    try:
        await pc.setLocalDescription(await pc.createOffer())
        async with sdk(base) as client:
            answer = await client.realtime.calls.create(
                sdp=pc.localDescription.sdp,
                session={"type": "realtime", "instructions": "Speak like a robot."},
            )
        await pc.setRemoteDescription(RTCSessionDescription(answer.text, "answer"))
        async with asyncio.timeout(20):
            created = await events.get()
        assert created["type"] == "session.created"
        assert created["session"]["instructions"] == "Speak like a robot."
    finally:
        await pc.close()


# the 1.3.0 that aiewf-eval pins and the current 1.x, each in a folder of its own
PIPECATS = Path(__file__).parents[2] / ".venv" / "clients"
PIPECAT_VERSIONS = ("1.3.0", "1.14.0")
# pipecat's own parser over every event: the types it refuses, and why (one line each)
PIPECAT_PARSE = """
import json, sys
from pipecat.services.openai.realtime.events import parse_server_event
for line in sys.stdin:
    try:
        parse_server_event(line)
    except Exception as exc:
        print(json.loads(line)["type"], str(exc).splitlines()[0][:200])
"""


def pipecat_refuses(events: list[str], version: str) -> list[str]:
    """The events pipecat's parser refuses (it stops the session at the first)."""
    folder = PIPECATS / f"pipecat-{version}"
    assert (folder / "pipecat").is_dir(), "scripts/setup.sh --test installs it"
    done = subprocess.run(
        [sys.executable, "-c", PIPECAT_PARSE],
        input="\n".join(events) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(folder)},
        check=True,
    )
    return done.stdout.splitlines()


async def test_pipecat_reads_every_event_of_a_session(base, make_speech) -> None:
    """pipecat's parser (1.3.0, what aiewf-eval pins, and the current 1.x) refuses any field of
    the wrong shape, and 1.3.0's any event type it does not know. A session as it drives one:
    LiveKit's default voice, a tool call and its output, a spoken answer, a barge-in over a
    long reply, the next turn."""
    from gateway import events as ev
    from gateway.session.replies import failed

    speech = make_speech("what is the weather like today in paris")
    raw: list[str] = []
    headers = {"Authorization": f"Bearer {KEY}"}
    url = base.replace("http", "ws") + "/v1/realtime?model=gpt-realtime"
    async with aiohttp.ClientSession(headers=headers) as http, http.ws_connect(url) as ws:

        async def until(kind: str, timeout: float = 60) -> dict[str, Any]:
            async with asyncio.timeout(timeout):
                async for msg in ws:
                    raw.append(msg.data)
                    event = json.loads(msg.data)
                    if event["type"] == kind:
                        return event
            raise AssertionError(f"the session ended before {kind}")

        async def say(event: dict[str, Any]) -> None:
            await ws.send_json(event)

        await until("session.created")
        tools = [WEATHER]
        voice = {"output": {"voice": "marin"}}
        await say(
            {
                "type": "session.update",
                "session": {"type": "realtime", "tools": tools, "audio": voice},
            }
        )
        await until("session.updated")
        text = {"type": "input_text", "text": "What is the weather in Paris?"}
        await say(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [text]},
            }
        )
        await say({"type": "response.create", "response": {"tool_choice": "required"}})
        called = (await until("response.done"))["response"]["output"][0]
        assert called["type"] == "function_call", called
        output = {"type": "function_call_output", "call_id": called["call_id"], "output": "Sunny."}
        await say({"type": "conversation.item.create", "item": output})
        await say({"type": "response.create"})
        assert (await until("response.done"))["response"]["status"] == "completed"
        # a long reply, and the caller speaks over it
        await say({"type": "response.create", "response": {"max_output_tokens": 400}})
        await until("response.output_audio.delta")
        for chunk in pcm24k_b64(np.concatenate([speech.pcm16, np.zeros(16000, np.int16)])):
            await say({"type": "input_audio_buffer.append", "audio": chunk})
        cut = await until("response.done")
        assert cut["response"]["status"] == "cancelled", cut
        assert (await until("response.done"))["response"]["status"] == "completed"

    types = {json.loads(e)["type"] for e in raw}
    assert {"input_audio_buffer.speech_started", "response.function_call_arguments.done"} <= types
    assert "error" not in types  # pipecat stops the session at one
    # a failed reply's end, as the session writes it
    failed_reply = ev.event(
        "response.done",
        response=ev.response_obj(
            "resp_f", "failed", status_details=failed("generation_failed"), usage=ev.usage()
        ),
    )
    vendor = json.dumps({"type": "omni.response.first_audio", "event_id": "e"})
    for version in PIPECAT_VERSIONS:
        assert pipecat_refuses([*raw, json.dumps(failed_reply)], version) == [], version
    # and 1.3.0's parser is strict (1.14's passes unknown types over): the gateway's own
    # events, which a client must ask for, would stop its session
    assert pipecat_refuses([vendor], "1.3.0")
