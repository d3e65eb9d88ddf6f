"""LiveKit Agents 1.8.9's OpenAI Realtime plugin (livekit-plugins-openai) against the real
gateway and stages, with API keys on, over a real WebSocket: its RealtimeModel pointed at the
gateway by base_url, and RealtimeModel.session() driven directly, standalone (no LiveKit room).
The plugin runs in a subprocess with .venv/clients/livekit-agents-1.8.9 on its path
(tests/clients/livekit-agents-1.8.9.txt says why it is installed apart), so that .venv's own
packages stay as they are; the script prints what it saw as JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.serving import tiny_call_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

KEY = "sk-omni-test-key"
LIVEKIT_1_8_9 = Path(__file__).parents[2] / ".venv" / "clients" / "livekit-agents-1.8.9"


@pytest.fixture(scope="module")
def config():
    return tiny_call_config(
        {"gateway.auth": {"enabled": True, "api_keys": [KEY], "api_keys_env": None}}
    )


@pytest.fixture(scope="module")
def base(server) -> str:
    return server[0]


# The plugin's session, driven as an agent would: its default options (voice marin,
# semantic_vad, gpt-4o-mini-transcribe, max_output_tokens "inf"), chat context items created
# and deleted, a reply asked for, a spoken turn answered and interrupted. Every wait is
# bounded; a step that fails says so ({"step": ..., "failed": ...}) and the next one runs; the
# last line has the events seen and what the plugin logged.
LIVEKIT_SESSION = r"""import asyncio
import functools
import itertools
import json
import logging
import sys
import wave

import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.plugins import openai
from openai.types.realtime import ResponseCancelEvent

BASE, KEY, SPEECH = sys.argv[1:4]


def say(step, **fields):
    print(json.dumps({"step": step, **fields}, default=str), flush=True)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        self.seen.append(
            {"logger": record.name, "level": record.levelname, "message": record.getMessage()}
        )


records = Records()
logging.getLogger("livekit").addHandler(records)  # livekit.agents, livekit.plugins.openai


class Events:
    def __init__(self):
        self.server, self.client, self.errors = [], [], []
        self.changed = asyncio.Event()

    def on_server(self, event):
        self.server.append(event)
        self.changed.set()

    async def next(self, kind, after=0, timeout=30.0, where=lambda event: True):
        # the first server event of this type (that `where` takes) from index `after` on
        async with asyncio.timeout(timeout):
            while True:
                for i in range(after, len(self.server)):
                    event = self.server[i]
                    if event["type"] == kind and where(event):
                        return i, event
                self.changed.clear()
                await self.changed.wait()

    def done_of(self, response_id):
        return next(
            (
                e["response"]
                for e in self.server
                if e["type"] == "response.done" and e["response"]["id"] == response_id
            ),
            None,
        )


async def consume(generation, first_audio=None):
    # what one generation carried, read as an agent's playout reads it, until it ends
    heard = {"messages": [], "samples": 0, "voiced": 0, "sumsq": 0.0, "text": ""}
    async for message in generation.message_stream:
        heard["messages"].append(message.message_id)

        async def audio(stream):
            async for frame in stream:
                assert frame.sample_rate == 24000 and frame.num_channels == 1
                pcm = np.frombuffer(bytes(frame.data), dtype=np.int16).astype(np.float64)
                heard["samples"] += len(pcm)
                heard["sumsq"] += float(np.sum(pcm**2))
                # the voice's first frames may be its leading silence: 100 ms of speech heard
                if np.sqrt(np.mean(pcm**2)) > 300:
                    heard["voiced"] += len(pcm)
                if first_audio is not None and heard["voiced"] > 2400:
                    first_audio.set()

        async def text(stream):
            async for piece in stream:
                heard["text"] += piece

        await asyncio.gather(audio(message.audio_stream), text(message.text_stream))
        heard["modalities"] = await message.modalities
    heard["functions"] = [call.name async for call in generation.function_stream]
    heard["seconds"] = heard["samples"] / 24000
    heard["rms"] = (heard["sumsq"] / heard["samples"]) ** 0.5 if heard["samples"] else 0.0
    del heard["sumsq"]
    return heard


def speech_frames():
    # make_speech's 16 kHz recording, then silence for the end of the turn, in 20 ms frames
    # as a room's track gives them: the plugin resamples to its 24 kHz (rtc.AudioResampler)
    with wave.open(SPEECH) as reader:
        rate = reader.getframerate()
        pcm = np.frombuffer(reader.readframes(reader.getnframes()), dtype=np.int16)
    pcm = np.concatenate([pcm, np.zeros(2 * rate, np.int16)])
    step = rate // 50
    for i in range(0, len(pcm) - step + 1, step):
        yield rtc.AudioFrame(pcm[i : i + step].tobytes(), rate, 1, step)


def runs(types):
    # event types in order, a run of one type as "type xN"
    grouped = [(kind, len(list(run))) for kind, run in itertools.groupby(types)]
    return [kind if n == 1 else f"{kind} x{n}" for kind, n in grouped]


async def step(name, run, timeout):
    # one step, bounded; a failed one is said, and the next steps still run
    try:
        say(name, **await asyncio.wait_for(run(), timeout))
    except BaseException as exc:
        say(name, failed=repr(exc))


async def main():
    events = Events()
    model = openai.realtime.RealtimeModel(base_url=f"{BASE}/v1", api_key=KEY)
    session = model.session()
    session.on("openai_server_event_received", events.on_server)
    session.on("openai_client_event_queued", events.client.append)
    session.on("error", lambda error: events.errors.append(repr(error.error)))
    generations = asyncio.Queue()
    session.on("generation_created", generations.put_nowait)
    asked = llm.ChatMessage(role="user", content=["My name is Ada. Say hello to me."])

    async def default_session():
        # the plugin's session.update, sent as the session starts, is taken whole
        await events.next("session.created")
        _, updated = await events.next("session.updated")
        sent = next(e for e in events.client if e["type"] == "session.update")["session"]
        return {
            "sent": sent,
            "updated": updated["session"],
            "url": session._create_ws_url_and_headers()[0],
        }

    async def item_created():
        # as update_chat_ctx sends it: conversation.item.create, previous_item_id "root"
        ctx = session.chat_ctx.copy()
        ctx.items.append(asked)
        await session.update_chat_ctx(ctx)
        _, added = await events.next(
            "conversation.item.added", where=lambda e: e["item"]["id"] == asked.id
        )
        remote = [item.id for item in session.chat_ctx.items]
        return {"item_id": asked.id, "added": added, "remote": remote}

    async def generate_reply(**options):
        # its future resolves on the response.created that carries its client_event_id
        at = len(events.server)
        generation = await session.generate_reply(**options)
        heard = await consume(generation)
        _, created = await events.next("response.created", after=at)
        return {
            "user_initiated": generation.user_initiated,
            "response_id": generation.response_id,
            "metadata": created["response"].get("metadata"),
            "done": events.done_of(generation.response_id),
            "heard": heard,
            "remote": [item.id for item in session.chat_ctx.items],
        }

    async def item_deleted():
        ctx = session.chat_ctx.copy()
        ctx.items[:] = [item for item in ctx.items if item.id != asked.id]
        await session.update_chat_ctx(ctx)
        _, deleted = await events.next(
            "conversation.item.deleted", where=lambda e: e["item_id"] == asked.id
        )
        remote = [item.id for item in session.chat_ctx.items]
        return {"item_id": asked.id, "deleted": deleted, "remote": remote}

    async def spoken_turn():
        # semantic_vad ends the turn and the server answers it; interrupt() while the answer
        # is being heard cancels it
        at = len(events.server)
        while not generations.empty():
            generations.get_nowait()
        for frame in speech_frames():
            session.push_audio(frame)
        await events.next("input_audio_buffer.speech_stopped", after=at, timeout=60)
        answer = await generations.get()
        first_audio = asyncio.Event()
        hearing = asyncio.create_task(consume(answer, first_audio))
        await first_audio.wait()
        still_going = events.done_of(answer.response_id) is None
        session.interrupt()
        heard = await asyncio.wait_for(hearing, 30)
        _, transcript = await events.next(
            "conversation.item.input_audio_transcription.completed", after=at
        )
        # what the agent played of it, as AgentActivity truncates an interrupted reply
        played_ms = int(heard["seconds"] * 1000) // 2
        session.truncate(
            message_id=heard["messages"][0], modalities=["audio", "text"], audio_end_ms=played_ms
        )
        _, truncated = await events.next("conversation.item.truncated", after=at)
        return {
            "user_initiated": answer.user_initiated,
            "response_id": answer.response_id,
            "still_going": still_going,
            "done": events.done_of(answer.response_id),
            "heard": heard,
            "transcript": transcript["transcript"],
            "active_after": session.has_active_generation,
            "played_ms": played_ms,
            "truncated": truncated,
        }

    async def reply_length(tokens):
        # update_options sends a session.update of that one field
        at = len(events.server)
        session.update_options(max_response_output_tokens=tokens)
        _, updated = await events.next("session.updated", after=at)
        return {"max_output_tokens": updated["session"]["max_output_tokens"]}

    async def late_cancel():
        # interrupt() when the plugin has not yet read the response.done of a reply that has
        # ended: its response.cancel reaches a session with no response, as in a barge-in
        # at a reply's end. OpenAI answers an error the plugin takes as benign ("Cancellation
        # failed", openai.py _handle_error); the plugin must log and surface nothing for it
        at, errors_before = len(events.server), len(events.errors)
        assert not session.has_active_generation
        session.send_event(ResponseCancelEvent(type="response.cancel", event_id="late_cancel"))
        _, error = await events.next("error", after=at)
        return {"error": error["error"], "surfaced": events.errors[errors_before:]}

    try:
        await step("session", default_session, 30)
        await step("item_created", item_created, 30)
        await step("shorter_replies", functools.partial(reply_length, 24), 30)
        # as after a tool call (no instructions: the plugin sends "instructions": null)
        await step("generate_reply", generate_reply, 90)
        # as AgentSession.generate_reply(instructions=...) does
        instructed = functools.partial(generate_reply, instructions="Greet Ada by name.")
        await step("generate_reply_instructed", instructed, 90)
        await step("item_deleted", item_deleted, 30)
        # a reply as long as the model makes it (160 tokens here), still going when interrupted
        await step("longer_replies", functools.partial(reply_length, "inf"), 30)
        await step("spoken_turn", spoken_turn, 120)
        await step("late_cancel", late_cancel, 30)
    finally:
        try:
            await asyncio.wait_for(session.aclose(), 15)
            await asyncio.wait_for(model.aclose(), 15)
        except BaseException as exc:
            say("closing", failed=repr(exc))
        say(
            "end",
            server=runs(e["type"] for e in events.server),
            server_errors=[
                e
                for e in events.server
                if e["type"] == "error" and e["error"].get("event_id") != "late_cancel"
            ],
            client=runs(e["type"] for e in events.client),
            errors=events.errors,
            logs=records.seen,
        )


asyncio.run(main())
"""


async def run_livekit(base: str, speech: Path) -> dict[str, dict[str, Any]]:
    """Each step's JSON line, by step (the subprocess's stderr on a failure)."""
    assert (LIVEKIT_1_8_9 / "livekit" / "plugins" / "openai").is_dir(), (
        "scripts/setup.sh --test installs it"
    )
    # an asyncio subprocess: the gateway serves on this event loop meanwhile
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        LIVEKIT_SESSION,
        base,
        KEY,
        str(speech),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(LIVEKIT_1_8_9)},
    )
    try:
        async with asyncio.timeout(240):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    steps = {}
    for line in out.decode().splitlines():
        if line.startswith("{"):
            step = json.loads(line)
            steps.setdefault(step["step"], step)
    print(out.decode(), err.decode()[-4000:], sep="\n")  # shown when the test fails
    assert proc.returncode == 0 and "end" in steps, err.decode()[-4000:]
    return steps


async def test_livekit_realtime_model_session(base, make_speech) -> None:
    speech = make_speech("what is the weather like today in paris")
    steps = await run_livekit(base, speech.path)
    end = steps.pop("end")
    failures = {name: step["failed"] for name, step in steps.items() if "failed" in step}
    context = json.dumps({"failed steps": failures, **end}, indent=1)[:8000]
    assert not failures, context

    # the default session (voice marin, semantic_vad), at the gateway's /v1/realtime
    session = steps["session"]
    assert session["url"] == base.replace("http", "ws") + "/v1/realtime?model=gpt-realtime"
    sent = session["sent"]["audio"]
    assert sent["output"]["voice"] == "marin"
    assert sent["input"]["turn_detection"]["type"] == "semantic_vad"
    updated = session["updated"]
    assert updated["audio"]["input"]["turn_detection"] == sent["input"]["turn_detection"]
    assert updated["output_modalities"] == ["audio"]
    assert updated["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}

    # conversation.item.create acknowledged: conversation.item.added with the plugin's id
    created = steps["item_created"]
    assert created["added"]["item"]["id"] == created["item_id"]
    assert created["remote"] == [created["item_id"]]

    # update_options' max_output_tokens taken, and back to "inf"
    assert steps["shorter_replies"] == {"step": "shorter_replies", "max_output_tokens": 24}
    assert steps["longer_replies"] == {"step": "longer_replies", "max_output_tokens": "inf"}

    # generate_reply resolved: response.created carried metadata.client_event_id back; the
    # reply was heard and ended complete, and its item joined the plugin's chat context
    reply = steps["generate_reply"]
    assert reply["user_initiated"] is True
    assert list(reply["metadata"]) == ["client_event_id"]
    assert reply["done"]["status"] == "completed"
    heard = reply["heard"]
    assert len(heard["messages"]) == 1 and heard["modalities"] == ["audio", "text"]
    assert heard["seconds"] > 0.5 and heard["rms"] > 300 and heard["text"]
    assert reply["remote"] == [created["item_id"], heard["messages"][0]]
    instructed = steps["generate_reply_instructed"]
    assert instructed["user_initiated"] is True and instructed["done"]["status"] == "completed"
    assert instructed["heard"]["seconds"] > 0.5 and instructed["heard"]["rms"] > 300
    replies = [heard["messages"][0], instructed["heard"]["messages"][0]]
    assert instructed["remote"] == [created["item_id"], *replies]

    # conversation.item.delete acknowledged: conversation.item.deleted
    deleted = steps["item_deleted"]
    assert deleted["deleted"]["item_id"] == deleted["item_id"]
    assert deleted["remote"] == replies

    # pushed speech answered out loud, and interrupt() cancelled the answer mid-reply
    spoken = steps["spoken_turn"]
    assert spoken["user_initiated"] is False and spoken["transcript"]
    assert spoken["still_going"], "the answer was over before interrupt()"
    assert spoken["heard"]["seconds"] > 0.1 and spoken["heard"]["rms"] > 300
    assert spoken["done"]["status"] == "cancelled"
    assert spoken["done"]["status_details"]["reason"] == "client_cancelled"
    assert spoken["active_after"] is False
    # and truncated to what was played, as AgentActivity does after an interruption
    assert spoken["truncated"]["item_id"] == spoken["heard"]["messages"][0]
    assert spoken["truncated"]["audio_end_ms"] == spoken["played_ms"]

    # a cancel that lands after the reply ended is refused as OpenAI refuses it, which the
    # plugin knows to be benign (it logs and surfaces nothing for "Cancellation failed")
    late = steps["late_cancel"]["error"]
    assert late["code"] == "response_cancel_not_active" and late["event_id"] == "late_cancel"
    assert late["message"].startswith("Cancellation failed"), late
    assert steps["late_cancel"]["surfaced"] == []

    # never an error but that one: no error event, none surfaced by the plugin, nothing it
    # logged as one
    assert end["server_errors"] == [], context
    assert end["errors"] == [], context
    assert [r for r in end["logs"] if r["level"] in ("ERROR", "CRITICAL")] == [], context
