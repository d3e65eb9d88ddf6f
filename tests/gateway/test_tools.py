"""Function and MCP tools, end to end: the offline profile's real models (Whisper tiny.en,
SmolLM2-135M on vLLM, the Piper voice) behind the gateway, driven by the official `openai`
SDK over the WebSocket, by the `openai-agents` SDK's RealtimeRunner, and over WebRTC by
gateway.client; MCP tools from an MCP server of the test's own (the SDK's MCPServer, FastMCP
before mcp 2) on 127.0.0.1. One module: every test shares one served pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from gateway.client import RealtimeCall
from gateway.config import load_config
from loadtest.tools_bench import WEATHER
from stages.audio import resample
from tests.gateway.sdk_events import Events, pcm24k_b64, text_turn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

OFFLINE = Path(__file__).parents[2] / "configs" / "offline.yaml"
KEY = "sk-omni-tools-key"
MCP_CALL_TIMEOUT_S = 3.0
OUTPUT_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def config():
    return load_config(
        OFFLINE,
        {
            "gateway.port": 0,
            "gateway.auth": {"enabled": True, "api_keys": [KEY], "api_keys_env": None},
            "gateway.tools": {
                "mcp_servers": ["http://127.0.0.1"],
                "mcp_call_timeout_s": MCP_CALL_TIMEOUT_S,
                "function_output_timeout_s": OUTPUT_TIMEOUT_S,
            },
            "max_sessions": 8,
        },
    )


@pytest.fixture(scope="module")
def mcp_url() -> Iterator[str]:
    """The test MCP server (tests/gateway/mcp_server.py), in a process of its own."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.gateway.mcp_server"],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("port "), f"the MCP server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp"
    finally:
        process.terminate()
        process.wait(10)
        process.stdout.close()


def mcp_tool(url: str, label: str = "weather") -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": url, "require_approval": "never"}


@contextlib.asynccontextmanager
async def realtime(base: str, **session: Any):
    """A WebSocket session through the openai SDK, with `session` applied (and its
    session.updated waited for); yields (connection, events)."""
    client = AsyncOpenAI(
        api_key=KEY, base_url=f"{base}/v1", websocket_base_url=base.replace("http", "ws") + "/v1"
    )
    # the gateway's omni.* events too (omni.response.cancelled: the cancel's acknowledgement)
    connect = client.realtime.connect(model="omni-gateway", extra_query={"omni_events": "on"})
    async with connect as conn:
        events = Events(conn)
        await events.next("session.created")
        if session:
            await conn.session.update(session={"type": "realtime", **session})
            await events.next("session.updated")
        yield conn, events


async def until(events: Events, kind: str, timeout: float = 60) -> list[dict[str, Any]]:
    """The events up to and including the next `kind`, in order."""
    start = len(events.seen)
    await events.next(kind, timeout=timeout)
    return events.seen[start:]


def of_type(seen: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in seen if e["type"] == kind]


async def test_function_call_then_its_output_answered_in_speech(server) -> None:
    """The GA function-call flow with the official SDK: a forced call streams its arguments
    (held to the tool's schema), the client answers with function_call_output and
    response.create, and the spoken reply reads the output."""
    base = server[0]
    async with realtime(base, tools=[WEATHER]) as (conn, events):
        await text_turn(
            conn, events, "What is the weather like in Paris today?", tool_choice="required"
        )
        seen = await until(events, "response.done")
        added = of_type(seen, "response.output_item.added")
        assert [a["item"]["type"] for a in added] == ["function_call"], seen
        call = added[0]["item"]
        assert call["name"] == "get_weather" and call["status"] == "in_progress"
        deltas = of_type(seen, "response.function_call_arguments.delta")
        done = of_type(seen, "response.function_call_arguments.done")[0]
        assert deltas and "".join(d["delta"] for d in deltas) == done["arguments"]
        assert done["call_id"] == call["call_id"] and done["item_id"] == call["id"]
        arguments = json.loads(done["arguments"])
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        response = seen[-1]["response"]
        assert response["status"] == "completed"
        assert [(o["type"], o["status"]) for o in response["output"]] == [
            ("function_call", "completed")
        ]
        # nothing was said, so no message and no audio
        assert not of_type(seen, "response.output_audio.delta")

        await conn.conversation.item.create(
            item={
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": "Sunny and 22 degrees Celsius.",
            }
        )
        await events.next("conversation.item.done")
        await conn.response.create()
        seen = await until(events, "response.done")
        assert seen[-1]["response"]["status"] == "completed"
        transcript = of_type(seen, "response.output_audio_transcript.done")[0]["transcript"]
        assert "22" in transcript or "sunny" in transcript.lower(), transcript
        assert of_type(seen, "response.output_audio.delta")
        # and the conversation goes on, its calls in the stage's own history now
        await text_turn(conn, events, "And in Rome?", tool_choice="required")
        seen = await until(events, "response.done")
        assert seen[-1]["response"]["status"] == "completed", seen[-1]
        assert of_type(seen, "response.function_call_arguments.done")


async def test_the_history_keeps_calls_and_outputs_in_order(server) -> None:
    base = server[0]
    async with realtime(base, tools=[WEATHER], tool_choice="required") as (conn, events):
        await text_turn(conn, events, "How warm is it in Rome?")
        seen = await until(events, "response.done")
        call = of_type(seen, "response.function_call_arguments.done")[0]
        await conn.conversation.item.create(
            item={"type": "function_call_output", "call_id": call["call_id"], "output": "30 C"}
        )
        item = (await events.next("conversation.item.added"))["item"]
        assert item["type"] == "function_call_output" and item["call_id"] == call["call_id"]
        # an output for a call that was never made is refused by name
        await conn.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": "call_none", "output": "x"},
            }
        )
        with pytest.raises(AssertionError, match="call_id"):
            await events.next("conversation.item.added", timeout=10)
        await conn.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
        retrieved = (await events.next("conversation.item.retrieved"))["item"]
        assert retrieved["output"] == "30 C"


async def test_named_choice_and_parallel_calls_off(server) -> None:
    base = server[0]
    clock = {**WEATHER, "name": "get_time", "description": "The time now in a city"}
    async with realtime(base, tools=[WEATHER, clock], parallel_tool_calls=False) as (conn, events):
        await text_turn(
            conn,
            events,
            "What is the weather in Oslo?",
            tool_choice={"type": "function", "name": "get_time"},
        )
        seen = await until(events, "response.done")
        names = [d["name"] for d in of_type(seen, "response.function_call_arguments.done")]
        assert names == ["get_time"]


async def test_agents_sdk_realtime_agent_runs_a_function_tool(server, config) -> None:
    """The openai-agents SDK's RealtimeRunner pointed at the gateway: the agent's
    function_tool is called with the model's arguments, its result goes back as a
    function_call_output, and the reply that follows is spoken."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner
    from agents.realtime.model_inputs import RealtimeModelSendSessionUpdate

    base = server[0]
    calls: list[str] = []
    session_box: list[Any] = []
    settings: Any = {
        "model_name": "omni-gateway",
        "voice": config.vocoder.voice,
        "tool_choice": "required",
        "output_modalities": ["audio"],
        "turn_detection": {"type": "server_vad"},
    }

    @function_tool
    async def get_weather(city: str) -> str:
        """The weather now in a city."""
        calls.append(city)
        # one lookup is forced (the small model would not call by itself); the reply that
        # reads it may speak
        await session_box[0].model.send_event(
            RealtimeModelSendSessionUpdate(session_settings={**settings, "tool_choice": "auto"})
        )
        return "Sunny and 22 degrees Celsius."

    agent = RealtimeAgent(name="weather", instructions="Answer briefly.", tools=[get_weather])
    runner = RealtimeRunner(agent, config={"model_settings": settings})
    session = await runner.run(
        model_config={
            # the gateway's default: OpenAI's events only, none the SDK reports as an error
            "url": base.replace("http", "ws") + "/v1/realtime",
            "api_key": KEY,
            "initial_model_settings": settings,
        }
    )
    kinds: list[str] = []
    async with session:
        session_box.append(session)
        await session.send_message("What is the weather in Paris?")
        async with asyncio.timeout(120):
            async for event in session:
                kinds.append(event.type)
                if event.type == "error":
                    pytest.fail(f"agents SDK error: {event.error}")
                if event.type == "tool_end":
                    assert event.output == "Sunny and 22 degrees Celsius."
                if event.type == "audio_end" and "tool_end" in kinds:
                    break  # the reply after the tool was spoken to its end
    assert calls and isinstance(calls[0], str)
    assert kinds.index("tool_start") < kinds.index("tool_end") < len(kinds) - 1


async def test_webrtc_spoken_question_calls_and_the_answer_is_heard(server, make_speech) -> None:
    """Over WebRTC with gateway.client: a spoken question ends in a function call on the
    data channel; the output goes back and the answer comes as audio on the track."""
    base = server[0]
    call = await RealtimeCall.connect(base, api_key=KEY)
    try:
        await call.next_event("session.created")
        call.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "tools": [WEATHER], "tool_choice": "required"},
            }
        )
        await call.next_event("session.updated")
        speech = make_speech("what is the weather like in paris")
        call.microphone.play(resample(speech.pcm16, 16000, 48000))
        done = await call.next_event("response.function_call_arguments.done", timeout=60)
        assert done["name"] == "get_weather" and "city" in json.loads(done["arguments"])
        assert (await call.next_event("response.done"))["response"]["status"] == "completed"
        call.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "function_call_output",
                    "call_id": done["call_id"],
                    "output": "Sunny and 22 degrees Celsius.",
                },
            }
        )
        call.send({"type": "response.create", "response": {"tool_choice": "none"}})
        started = await call.next_event("output_audio_buffer.started", timeout=60)
        reply = await call.next_event("response.done", timeout=60)
        assert reply["response"]["status"] == "completed"
        assert started["response_id"] == reply["response"]["id"]
        await call.next_event("output_audio_buffer.stopped", timeout=60)
        assert call.speaker.pcm().any()
    finally:
        await call.close()


async def test_mcp_tools_listed_called_and_answered_without_a_round_trip(server, mcp_url) -> None:
    base = server[0]
    async with realtime(base, tools=[mcp_tool(mcp_url)]) as (conn, events):
        await events.next("mcp_list_tools.completed")
        item_id = of_type(events.seen, "mcp_list_tools.in_progress")[0]["item_id"]
        listed = (await events.next("conversation.item.done"))["item"]
        assert listed["id"] == item_id and listed["type"] == "mcp_list_tools"
        assert {t["name"] for t in listed["tools"]} == {"get_weather", "slow_lookup", "broken_tool"}

        await text_turn(
            conn,
            events,
            "What is the weather in Paris?",
            tool_choice={"type": "mcp", "server_label": "weather", "name": "get_weather"},
        )
        seen = await until(events, "response.done")
        call = of_type(seen, "response.output_item.added")[0]["item"]
        assert call["type"] == "mcp_call" and call["server_label"] == "weather"
        assert of_type(seen, "response.mcp_call_arguments.done")
        assert of_type(seen, "response.mcp_call.in_progress")
        assert of_type(seen, "response.mcp_call.completed")
        made = seen[-1]["response"]["output"][0]
        assert made["status"] == "completed" and "22 degrees" in made["output"]
        # the reply that reads the answer follows by itself
        follow = await until(events, "response.done")
        assert of_type(follow, "response.created")
        assert follow[-1]["response"]["status"] == "completed"
        transcript = of_type(follow, "response.output_audio_transcript.done")[0]["transcript"]
        assert transcript


async def test_mcp_failures_end_in_a_spoken_fallback_or_an_error(server, mcp_url) -> None:
    """A tool that raises, one slower than the call timeout, a server that is down, one the
    gateway may not reach: each is an error the client sees, never a hang."""
    base = server[0]
    async with realtime(base, tools=[mcp_tool(mcp_url)]) as (conn, events):
        await events.next("mcp_list_tools.completed")
        for name, arguments_hint in (("broken_tool", None), ("slow_lookup", "seconds")):
            started = time.monotonic()
            await text_turn(
                conn,
                events,
                "Look it up for 30 seconds please.",
                tool_choice={"type": "mcp", "server_label": "weather", "name": name},
            )
            seen = await until(events, "response.done")
            assert of_type(seen, "response.mcp_call.failed"), name
            error = seen[-1]["response"]["output"][0]["error"]
            if arguments_hint is None:
                assert error["type"] == "tool_execution_error"
            else:
                assert error["type"] == "http_error" and "timed out" in error["message"]
                assert time.monotonic() - started < MCP_CALL_TIMEOUT_S + 15
            follow = await until(events, "response.done")  # the model is told, and speaks
            assert follow[-1]["response"]["status"] == "completed"

    async with realtime(base) as (conn, events):
        await conn.session.update(
            session={"type": "realtime", "tools": [mcp_tool("http://127.0.0.1:9/mcp", "down")]}
        )
        seen = []
        with pytest.raises(AssertionError, match="mcp_list_tools_failed"):
            seen = await until(events, "never", timeout=MCP_CALL_TIMEOUT_S + 20)
        assert "mcp_list_tools.failed" in events.types(), seen
        await conn.session.update(
            session={"type": "realtime", "tools": [mcp_tool("http://10.1.2.3/mcp", "far")]}
        )
        with pytest.raises(AssertionError, match="mcp_server_not_allowed"):
            await events.next("session.updated", timeout=10)
        await text_turn(conn, events, "Are you there?", output_modalities=["text"])
        assert (await events.next("response.done"))["response"]["status"] == "completed"


async def test_cancels_during_a_call_stop_it_and_the_next_turn_is_not_delayed(
    server, mcp_url
) -> None:
    """A cancel while a call's arguments stream, and one while an MCP call runs (its late
    answer dropped, no reply following it); each acknowledged, the next turn answered at
    once. Another session meanwhile goes on."""
    base = server[0]
    forecast = {**WEATHER, "name": "get_forecast"}
    async with (
        realtime(base, tools=[forecast, mcp_tool(mcp_url)]) as (conn, events),
        realtime(base) as (other, other_events),
    ):
        await events.next("mcp_list_tools.completed")
        await text_turn(
            conn,
            events,
            "What is the weather in Paris?",
            tool_choice={"type": "function", "name": "get_forecast"},
        )
        await events.next("response.function_call_arguments.delta")
        await conn.response.cancel()
        seen = await until(events, "response.done")
        assert seen[-1]["response"]["status"] == "cancelled"
        assert seen[-1]["response"]["output"][0]["status"] == "incomplete"
        assert (await events.next("omni.response.cancelled"))["cancel_latency_ms"] < 1000

        await text_turn(
            conn,
            events,
            "Look it up slowly.",
            tool_choice={"type": "mcp", "server_label": "weather", "name": "slow_lookup"},
        )
        await events.next("response.mcp_call.in_progress")
        # meanwhile another session is answered
        await text_turn(other, other_events, "What color is grass?", output_modalities=["text"])
        assert (await other_events.next("response.done"))["response"]["status"] == "completed"
        await conn.response.cancel()
        seen = await until(events, "response.done")
        assert seen[-1]["response"]["status"] == "cancelled"
        assert seen[-1]["response"]["output"][0]["status"] == "incomplete"
        started = time.monotonic()
        await text_turn(conn, events, "What color is the sky?", tool_choice="none")
        seen = await until(events, "response.done")
        assert time.monotonic() - started < 15
        assert seen[-1]["response"]["status"] == "completed"
        assert not of_type(seen, "response.mcp_call.completed")
        # nothing more of the cut call comes, not even once its answer would have
        with pytest.raises(TimeoutError):
            await events.next("response.mcp_call.completed", "response.created", timeout=6)


async def test_an_output_that_never_comes_is_an_error_and_the_call_goes_on(
    server, make_speech
) -> None:
    base = server[0]
    async with realtime(base, tools=[WEATHER], tool_choice="required") as (conn, events):
        await text_turn(conn, events, "What is the weather in Paris?")
        await events.next("response.done")
        with pytest.raises(AssertionError, match="function_call_output_timeout"):
            await events.next("never", timeout=OUTPUT_TIMEOUT_S + 10)
        await conn.session.update(session={"type": "realtime", "tool_choice": "none"})
        await events.next("session.updated")
        for chunk in pcm24k_b64(make_speech("what color is grass").pcm16):
            await conn.input_audio_buffer.append(audio=chunk)
        seen = await until(events, "response.done")
        assert seen[-1]["response"]["status"] == "completed"
