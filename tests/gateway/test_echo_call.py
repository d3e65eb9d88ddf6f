"""Callers on a speakerphone (loadtest.speakerphone: the agent's audio they were played comes
back into their microphone, late, quieter, through a room, under noise), over the phone
endpoint and over WebRTC with the gateway's client, against the tiny profile's real stages
(pocketsphinx, vLLM on the tiny model, espeak-ng). Without the echo canceller the agent hears
itself; with it, it finishes its replies, a real barge-in still cuts it, and the caller's words
over the agent are still transcribed; a caller with no echo path is found to have none."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from gateway.app import gateway_of
from gateway.client import RealtimeCall
from loadtest.phone import PhoneCall
from loadtest.speakerphone import EchoSettings, Speakerphone
from stages.audio import resample
from tests.serving import tiny_call_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

ECHO = EchoSettings(delay_ms=150, attenuation_db=10, room_ms=60, noise_dbfs=-60)
QUESTION = "what is the weather like today in paris"
BARGE_IN = "stop please tell me about the train to london"
BARGE_IN_AFTER_S = 1.5  # into the agent's reply


@pytest.fixture(scope="module")
def config():
    return tiny_call_config(
        {
            "gateway.max_output_tokens": 40,  # replies of several seconds
            # the phone's canceller is on by default; a headset (near_field) has none
            "gateway.telephony": {
                "profiles": {
                    "headset": {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}},
                    "long": {"max_output_tokens": 120},
                }
            },
        }
    )


def speech_started(app) -> float:
    registry = gateway_of(app).metrics.registry
    value = registry.get_sample_value("omni_vad_events_total", {"event": "speech_started"})
    return value or 0.0


def cut_leading_silence(pcm: np.ndarray) -> np.ndarray:
    return pcm[int(np.argmax(np.abs(pcm) > 500)) :]


def the_call(app, prefix: str):
    [call] = [c for c in gateway_of(app).calls.values() if c.call_id.startswith(prefix)]
    return call


# -- the phone -------------------------------------------------------------------------------


def phone_url(base: str) -> str:
    return base.replace("http", "ws") + "/v1/telephony/twilio"


def speech8k(make_speech, text: str) -> np.ndarray:
    return resample(cut_leading_silence(make_speech(text).pcm16), 16000, 8000)


async def phone_reply(app, phone: PhoneCall, make_speech) -> dict[str, float]:
    """Ask the question and hear the whole reply on the speakerphone: what the VAD heard meanwhile
    and whether the agent stopped."""
    phone.say(speech8k(make_speech, QUESTION))
    _, said_end = await phone.until_said(1)
    await phone.until_agent_speaks(after=said_end, timeout=60)
    heard_before = speech_started(app)
    done = len([m for m in phone.marks_echoed if m.startswith("done.")])
    async with asyncio.timeout(90):  # the reply heard to its end, or cut
        while not phone.clears and done == len(
            [m for m in phone.marks_echoed if m.startswith("done.")]
        ):
            await asyncio.sleep(0.02)
    return {"speech_started": speech_started(app) - heard_before, "clears": len(phone.clears)}


async def test_on_the_phone_without_the_canceller_the_agent_hears_itself(
    server, make_speech
) -> None:
    base, app = server
    async with PhoneCall.dial(
        phone_url(base), {"profile": "headset"}, speakerphone=Speakerphone(8000, ECHO)
    ) as phone:
        seen = await phone_reply(app, phone, make_speech)
        echo = the_call(app, "tel").echo
        assert echo is not None and not echo.processing.echo  # the noise suppressor only
    assert seen["speech_started"] > 0 or seen["clears"], seen


async def test_on_the_phone_the_canceller_lets_the_agent_finish_and_hears_a_barge_in(
    server, make_speech
) -> None:
    base, app = server
    async with PhoneCall.dial(
        phone_url(base), {"profile": "long"}, speakerphone=Speakerphone(8000, ECHO)
    ) as phone:
        phone.say(speech8k(make_speech, QUESTION))
        _, said_end = await phone.until_said(1)
        spoke = await phone.until_agent_speaks(after=said_end, timeout=60)
        call = the_call(app, "tel")
        assert call.echo is not None and call.echo.processing.echo  # the phone's default
        heard_before = speech_started(app)
        # seconds of the agent on the speakerphone: nothing heard as the caller's speech
        async with asyncio.timeout(30):
            while phone.heard.size < (BARGE_IN_AFTER_S + 1.0) * 8000 and not phone.clears:
                await asyncio.sleep(0.05)
        assert speech_started(app) == heard_before, "the agent's echo was heard as speech"
        assert not phone.clears
        assert call.echo.echo_path.present  # its echo found, the caller's turn notwithstanding
        # a real barge-in over the agent (and its echo): cut, and its words transcribed
        phone.say(speech8k(make_speech, BARGE_IN))
        async with asyncio.timeout(15):
            while not phone.clears:
                await asyncio.sleep(0.02)
        assert phone.clears[0] - phone.onsets[1] < 3.0, "the barge-in was heard late"
        assert phone.clears[0] > spoke
        async with asyncio.timeout(60):
            while len(words := user_words(call)) < 2:
                await asyncio.sleep(0.05)
        assert words[1] & set(BARGE_IN.split()), words


async def test_on_the_phone_with_no_echo_path_the_canceller_steps_aside(
    server, make_speech
) -> None:
    """A handset or a headset on the phone, whose default is the canceller: once the agent has
    played, the microphone is found to hear none of it, and AEC3's output is no longer used
    (its suppressor would take the caller's words over the agent for echo)."""
    base, app = server
    async with PhoneCall.dial(phone_url(base), {"profile": "long"}) as phone:
        seen = await phone_reply(app, phone, make_speech)
        echo = the_call(app, "tel").echo
        assert echo is not None and echo.processing.echo  # the phone's default
        assert echo.echo_path.rise_db is not None, "the agent's reply was too short to judge"
        assert not echo.echo_path.present, echo.echo_path.rise_db
    assert seen == {"speech_started": 0, "clears": 0}, seen


def user_words(call) -> list[set[str]]:
    """The words of each of the caller's turns, as transcribed."""
    turns = []
    for item in call.items:
        if item.role == "user" and item.content and item.content[0].get("transcript"):
            turns.append(set(item.content[0]["transcript"].lower().split()))
    return turns


# -- WebRTC ---------------------------------------------------------------------------------


SILENT_RMS = 30.0  # Opus silence decodes to a few LSBs


def voiced_frames(call: RealtimeCall, since: float) -> list[float]:
    heard = zip(call.speaker.arrivals, call.speaker.levels, strict=True)
    return [t for t, level in heard if t >= since and level > SILENT_RMS]


TRANSCRIBED = "conversation.item.input_audio_transcription.completed"


def events_since(call: RealtimeCall, since: float, kind: str) -> list[dict]:
    return [event for t, event in call.history if t >= since and event["type"] == kind]


def speech48k(make_speech, text: str) -> np.ndarray:
    return resample(cut_leading_silence(make_speech(text).pcm16), 16000, 48000)


async def webrtc_reply(call: RealtimeCall, make_speech) -> list[str]:
    """Ask the question and hear the reply through: the events from its start to its end."""
    call.microphone.play(speech48k(make_speech, QUESTION))
    await call.next_event("response.created", timeout=60)
    seen = []
    async with asyncio.timeout(90):
        while True:
            event = await call.next_event()
            seen.append(event["type"])
            if event["type"] == "response.done":
                seen.append(event["response"]["status"])
                return seen


async def test_over_webrtc_without_the_canceller_the_agent_hears_itself(
    server, make_speech
) -> None:
    base, app = server
    # WebRTC's default: no canceller (browsers have their own)
    call = await RealtimeCall.connect(base, speakerphone=Speakerphone(48000, ECHO))
    try:
        await call.next_event("session.created")
        assert the_call(app, call.call_id).echo is None
        seen = await webrtc_reply(call, make_speech)
    finally:
        await call.close()
    assert "input_audio_buffer.speech_started" in seen or "cancelled" in seen, seen


async def test_over_webrtc_far_field_lets_the_agent_finish_and_hears_a_barge_in(
    server, make_speech
) -> None:
    base, app = server
    call = await RealtimeCall.connect(base, speakerphone=Speakerphone(48000, ECHO))
    try:
        await call.next_event("session.created")
        far = {"audio": {"input": {"noise_reduction": {"type": "far_field"}}}}
        call.send({"type": "session.update", "session": far})
        updated = await call.next_event("session.updated", timeout=10)
        assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
        session = the_call(app, call.call_id)
        assert session.echo is not None and session.echo.processing.echo
        seen = await webrtc_reply(call, make_speech)
        assert "input_audio_buffer.speech_started" not in seen, seen
        assert seen[-1] == "completed"
        # the next reply, talked over
        call.send({"type": "session.update", "session": {"max_output_tokens": 120}})
        await call.next_event("session.updated", timeout=10)
        call.microphone.play(speech48k(make_speech, QUESTION))
        await call.next_event("output_audio_buffer.started", timeout=60)
        replying = time.monotonic()
        async with asyncio.timeout(30):
            while len(voiced_frames(call, since=replying)) < BARGE_IN_AFTER_S * 50:
                assert not events_since(call, replying, "input_audio_buffer.speech_started")
                await asyncio.sleep(0.05)
        barge_in = time.monotonic()
        call.microphone.play(speech48k(make_speech, BARGE_IN))
        done = await call.next_event("response.done", timeout=30)
        assert done["response"]["status"] == "cancelled"
        assert events_since(call, barge_in, "input_audio_buffer.speech_started")
        # the barge-in's words, transcribed under the agent's echo
        async with asyncio.timeout(60):
            while not (heard := events_since(call, barge_in, TRANSCRIBED)):
                await asyncio.sleep(0.05)
        assert set(heard[0]["transcript"].lower().split()) & set(BARGE_IN.split()), heard
    finally:
        await call.close()
