"""VllmEngine on a real vLLM AsyncLLM serving the tiny random-weight chat model.

One engine is started for the whole module (start-up takes 20-50 s on 2 CPU cores); every test
leaves it idle, and the abort tests check that nothing is left behind before the engine is reused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from stages.backends import model_cache, tiny_chat_model
from stages.backends.llm_vllm import EngineConfigError, ModelNotFoundError, VllmEngine
from stages.backends.tiny_chat_model import ensure_tiny_chat_model
from stages.backends.tool_parsing import (
    CallArguments,
    CallStarted,
    ToolCalls,
    ToolTemplateError,
    Words,
    chat_tools,
    parser_class,
    tool_chat_template,
)
from stages.backends.vllm_stats import StepLog
from stages.messages import Tool, Tools

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    # torch 2.13 warns when vLLM imports torch.utils.mkldnn, which still uses torch.jit.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# 16 blocks of 128 tokens, one of them vLLM's null block: each block is 1/15 of the usage.
ENGINE_ARGS = {"num_gpu_blocks_override": 16, "max_model_len": 512}
# Random weights sample <|im_end|> now and then; ignore_eos keeps the stream lengths fixed.
SAMPLING = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
MESSAGES = [
    {"role": "system", "content": "You are a helpful voice assistant."},
    {"role": "user", "content": "What does the with statement do?"},
]
LONG = {"max_tokens": 400}

# The engine fixture lives on the module's event loop; tests that use it must run there too.
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model: Path) -> AsyncIterator[VllmEngine]:
    """The module's engine; vLLM's sockets are in the engine's own folder, gone at shutdown."""
    started = time.monotonic()
    engine = await VllmEngine.start(str(tiny_model), ENGINE_ARGS, SAMPLING)
    print(f"\nvLLM start-up: {time.monotonic() - started:.1f} s")
    assert engine.socket_dir is not None
    assert any(p.is_socket() for p in engine.socket_dir.iterdir())
    yield engine
    engine.shutdown()
    assert not engine.socket_dir.exists()


async def _assert_idle(engine: VllmEngine) -> None:
    assert await engine.wait_kv_idle(timeout=1.0) == 0.0
    assert engine.num_unfinished_requests() == 0


@module_loop
async def test_streams_text_deltas(engine: VllmEngine) -> None:
    ttfts, inter_token = [], []
    for i in range(3):  # the first request after start-up is slower: report the last
        sent = time.monotonic()
        arrivals: list[float] = []
        deltas: list[str] = []
        async for delta in engine.generate(f"stream-{i}", MESSAGES):
            arrivals.append(time.monotonic())
            deltas.append(delta)
        assert len(deltas) >= 5
        assert all(isinstance(d, str) and d for d in deltas)
        ttfts.append(arrivals[0] - sent)
        inter_token.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
        await _assert_idle(engine)
    print(
        f"\n{len(deltas)} deltas; TTFT {', '.join(f'{t * 1e3:.1f}' for t in ttfts)} ms; "
        f"inter-token {', '.join(f'{t * 1e3:.2f}' for t in inter_token)} ms"
    )


@module_loop
async def test_two_concurrent_streams(engine: VllmEngine) -> None:
    spans: dict[str, tuple[float, float]] = {}
    usage_seen: list[float] = []

    async def consume(request_id: str) -> list[str]:
        deltas, first = [], 0.0
        async for delta in engine.generate(request_id, MESSAGES, {"max_tokens": 48}):
            first = first or time.monotonic()
            deltas.append(delta)
            usage_seen.append(engine.kv_usage())
        spans[request_id] = (first, time.monotonic())
        return deltas

    a, b = await asyncio.gather(consume("pair-a"), consume("pair-b"))
    assert len(a) >= 5 and len(b) >= 5
    # Both were being decoded at once (continuous batching), not one after the other.
    assert spans["pair-b"][0] < spans["pair-a"][1] and spans["pair-a"][0] < spans["pair-b"][1]
    assert max(usage_seen) == pytest.approx(2 / 15)  # one block each: the prompts are short
    await _assert_idle(engine)


@module_loop
async def test_the_step_log_tells_a_prefill_step_from_decoding(engine: VllmEngine) -> None:
    """A prompt that comes while another reply decodes is prefilled in a step the log counts
    apart, with the prompt's tokens; vLLM's stats carry them (0.26's and 0.32's alike)."""
    engine._kv.steps = steps = StepLog(every_s=3600)
    first = engine.generate("steps-a", MESSAGES, {"max_tokens": 24})
    for _ in range(4):
        await anext(first)
    second = [d async for d in engine.generate("steps-b", MESSAGES, {"max_tokens": 4})]
    rest = [d async for d in first]  # (deltas, not tokens: a slow reader gets several in one)
    assert second and rest
    assert len(steps._prefill) >= 1 and steps._prompt_tokens >= 10  # the chat template's too
    assert len(steps._decode) >= 15
    assert min(steps._decode + steps._prefill) > 0
    await _assert_idle(engine)


@module_loop
async def test_abort_mid_stream_ends_stream_and_frees_kv(engine: VllmEngine) -> None:
    stream = engine.generate("abort-1", MESSAGES, LONG)
    for _ in range(5):
        await anext(stream)
    assert engine.kv_usage() > 0.0

    aborted = time.monotonic()
    await engine.abort("abort-1")
    after = [delta async for delta in stream]
    ended = time.monotonic()
    usage = await engine.wait_kv_idle(timeout=0.05)
    freed = time.monotonic()
    print(
        f"\nabort -> stream end {(ended - aborted) * 1e3:.2f} ms, "
        f"abort -> KV idle {(freed - aborted) * 1e3:.2f} ms"
    )
    assert after == []
    assert usage == 0.0
    await engine.abort("abort-1")  # idempotent, also once the request is gone
    await engine.abort("never-existed")
    await _assert_idle(engine)


@module_loop
async def test_kv_usage_after_abort_with_another_stream_running(engine: VllmEngine) -> None:
    kept = engine.generate("kept-1", MESSAGES, LONG)
    dropped = engine.generate("dropped-1", MESSAGES, LONG)
    for _ in range(5):
        await anext(kept)
        await anext(dropped)
    assert engine.kv_usage() == pytest.approx(2 / 15)

    waits = engine._kv.abort_waits.totals
    freed_before = waits["freed_first_step"] + waits["freed_later_step"]
    seq, before = engine.kv_stats_seq(), engine.kv_usage()
    aborted = time.monotonic()
    await engine.abort("dropped-1")
    usage = await engine.kv_usage_after_abort(seq, before)
    print(f"\nabort -> KV freed (one stream left) {(time.monotonic() - aborted) * 1e3:.2f} ms")
    assert usage == pytest.approx(1 / 15)  # the kept stream's one block
    assert waits["freed_first_step"] + waits["freed_later_step"] == freed_before + 1
    assert [d async for d in dropped] == []
    await kept.aclose()
    await _assert_idle(engine)

    # Idle engine: nothing to free and no stats coming; the answer must not wait for them.
    seq = engine.kv_stats_seq()
    asked = time.monotonic()
    assert await engine.kv_usage_after_abort(seq, engine.kv_usage(), timeout=1.0) == 0.0
    assert time.monotonic() - asked < 0.5  # not the timeout (a loaded CI machine may stall)


@module_loop
async def test_aborting_the_only_stream_is_confirmed_without_waiting_for_stats(
    engine: VllmEngine,
) -> None:
    """The engine goes idle once its only request is aborted and sends no more stats: the
    confirmation comes from a round trip through its input queue, not from the timeout."""
    only = engine.generate("only-1", MESSAGES, LONG)
    for _ in range(3):
        await anext(only)
    assert engine.kv_usage() > 0
    waits = engine._kv.abort_waits.totals
    before = waits["idle_after_abort"]
    asked = time.monotonic()
    usage = await engine.abort_confirmed(["only-1"], timeout=2.0)
    took = time.monotonic() - asked
    print(f"\nabort of the only stream -> confirmed {took * 1e3:.2f} ms")
    assert usage == 0.0
    assert waits["idle_after_abort"] == before + 1
    assert waits["timed_out"] == 0
    assert took < 1.0  # a round trip, not the 2 s timeout (a loaded CI machine may stall)
    assert [d async for d in only] == []
    await _assert_idle(engine)


@module_loop
async def test_consumer_cancel_and_close_abort_the_request(engine: VllmEngine) -> None:
    # Closing the generator (a consumer that stops reading) aborts.
    stream = engine.generate("close-1", MESSAGES, LONG)
    await anext(stream)
    assert engine.num_unfinished_requests() == 1
    await stream.aclose()
    await _assert_idle(engine)

    # Cancelling the task that consumes it (barge-in) aborts too.
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancel-1", MESSAGES, LONG):
            first.set()

    task = asyncio.create_task(consume(), name="consume-cancel-1")
    await asyncio.wait_for(first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _assert_idle(engine)


@module_loop
async def test_engine_reusable_after_aborts(engine: VllmEngine) -> None:
    """vLLM's abort test: abort some of many streams, check nothing is left, then reuse."""
    request_ids = [f"many-{i}" for i in range(6)]
    to_abort = set(request_ids[::2])
    counts: dict[str, int] = {}

    async def consume(request_id: str) -> None:
        counts[request_id] = 0
        async for _ in engine.generate(request_id, MESSAGES, {"max_tokens": 32}):
            counts[request_id] += 1
            if request_id in to_abort and counts[request_id] == 3:
                await engine.abort(request_id)

    await asyncio.gather(*(consume(r) for r in request_ids))
    assert all(counts[r] == 3 for r in to_abort)
    assert all(counts[r] >= 5 for r in set(request_ids) - to_abort)
    await _assert_idle(engine)

    deltas = [delta async for delta in engine.generate("after-aborts", MESSAGES)]
    assert len(deltas) >= 5
    await _assert_idle(engine)


@module_loop
async def test_missing_model_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=re.escape(str(missing))):
        await VllmEngine.start(str(missing), ENGINE_ARGS, SAMPLING)
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        await VllmEngine.start(str(tmp_path), ENGINE_ARGS, SAMPLING)


@module_loop
async def test_bad_engine_arg_and_sampling_key_are_named(tiny_model: Path) -> None:
    with pytest.raises(
        EngineConfigError, match=r"'num_gpu_blockz_override'.*'num_gpu_blocks_override'"
    ):
        await VllmEngine.start(str(tiny_model), {"num_gpu_blockz_override": 16}, SAMPLING)
    with pytest.raises(EngineConfigError, match="'temprature'"):
        await VllmEngine.start(str(tiny_model), ENGINE_ARGS, {"temprature": 0.5})
    with pytest.raises(EngineConfigError, match="max_model_len"):  # the model has 2048 positions
        await VllmEngine.start(str(tiny_model), {"max_model_len": 4096}, SAMPLING)


def test_tiny_model_build_is_idempotent_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[Path] = []

    def fake_build(folder: Path) -> None:
        builds.append(folder)
        (folder / "config.json").write_text("{}")
        (folder / model_cache.COMPLETE_MARKER).write_text("ok\n")

    monkeypatch.setattr(tiny_chat_model, "_build", fake_build)
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text("half-written")  # no completion marker: rebuilt
    assert ensure_tiny_chat_model(target) == target
    assert ensure_tiny_chat_model(target) == target
    assert len(builds) == 1
    assert (target / "config.json").read_text() == "{}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny-")]  # staging removed


def test_tiny_model_folder_is_marked_random(tiny_model: Path) -> None:
    assert model_cache.is_complete(tiny_model)
    assert tiny_chat_model.has_random_weights(tiny_model)


def test_kv_usage_after_abort_does_not_count_records_made_before_the_abort_was_sent() -> None:
    """Records handled while the abort was still being sent (a busy event loop) left the core
    before it: the usage comes from records after it, not from the second of those."""
    from stages.backends.vllm_stats import KvUsageMonitor

    async def scenario() -> float:
        engine = VllmEngine.__new__(VllmEngine)  # the KV monitor only, no vLLM
        engine._llm, engine._kv = None, (kv := KvUsageMonitor())
        kv.update(0.2, requests=2)
        seq, before = kv.seq, kv.usage
        kv.update(0.2, requests=2)  # handled while the abort was being sent
        kv.update(0.2, requests=2)
        sent = kv.seq
        waiting = asyncio.ensure_future(engine.kv_usage_after_abort(seq, before, sent_seq=sent))
        await asyncio.sleep(0)
        assert not waiting.done()  # two records since CANCEL, none since the abort went out
        kv.update(0.1, requests=1)  # the step after the abort reached the core
        return await asyncio.wait_for(waiting, 1.0)

    assert asyncio.run(scenario()) == 0.1  # (seen at the 3rd record since the CANCEL)


def test_an_abort_hidden_by_other_requests_growth_is_acked_after_a_second_step() -> None:
    """Other replies may take as many new blocks in the step that frees the aborted one's:
    the usage does not fall, and the wait ends at the second record after the abort."""
    from stages.backends.vllm_stats import KvUsageMonitor

    async def scenario() -> tuple[float, dict[str, int]]:
        engine = VllmEngine.__new__(VllmEngine)  # the KV monitor only, no vLLM
        engine._llm, engine._kv = None, (kv := KvUsageMonitor())
        kv.update(0.2, requests=8)
        seq, before = kv.seq, kv.usage
        waiting = asyncio.ensure_future(engine.kv_usage_after_abort(seq, before))
        kv.update(0.25, requests=8)  # the aborted reply's blocks freed, others' new ones taken
        await asyncio.sleep(0)
        assert not waiting.done()
        kv.update(0.26, requests=8)
        usage = await asyncio.wait_for(waiting, 1.0)
        late = await engine.kv_usage_after_abort(kv.seq, kv.usage, timeout=0.01)
        return usage + late, dict(kv.abort_waits.totals)

    usage, waits = asyncio.run(scenario())
    assert usage == pytest.approx(0.52)
    assert waits == {"hidden": 1, "timed_out": 1}


def test_the_step_log_times_busy_steps_by_kind(caplog: pytest.LogCaptureFixture) -> None:
    """The first step after an idle engine is not timed: the gap before it was idle time."""
    log = StepLog(every_s=3600)
    log.add(100.000, busy=False, prompt_tokens=0)  # the engine went idle
    log.add(105.000, busy=True, prompt_tokens=30, usage=0.1)  # a prompt came 5 s later
    log.add(105.010, busy=True, prompt_tokens=0, usage=0.1)
    log.add(105.030, busy=True, prompt_tokens=50, usage=0.3)  # another, beside the first reply
    log.every_s = 0
    with caplog.at_level(logging.INFO, logger="stages.backends.vllm_stats"):
        log.add(105.040, busy=False, prompt_tokens=0, usage=0.0)
    (record,) = caplog.records
    assert record.getMessage() == (
        "vLLM steps in 5 s, record to record: decoding only 2, p50 10.0 ms, p99 10.0 ms, "
        "max 10.0 ms; finishing a prefill (50 prompt tokens a step) 1, p50 20.0 ms, "
        "p99 20.0 ms, max 20.0 ms; KV cache held p50 10.0%, p99 29.6%, max 30.0%"
    )


# -- function calling (stages.backends.tool_parsing) ------------------------------------------

WEATHER = Tool(
    "get_weather",
    "The weather now in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        }
    ),
)
CLOCK = Tool("get_time", "The time now", '{"type": "object", "properties": {}}')


async def _calls(engine: VllmEngine, tools: Tools, request_id: str) -> tuple[list, list]:
    template = tool_chat_template(None, engine.tokenizer.chat_template)
    calls = ToolCalls(tools, MESSAGES, parser_class("hermes", engine.tokenizer), engine.tokenizer)
    sampling = {"max_tokens": 200, "ignore_eos": False, **calls.sampling()}
    pieces = []
    async for text, ids, finished in engine.generate_pieces(
        request_id, MESSAGES, sampling, chat_tools(tools), template
    ):
        pieces += calls.feed(text, ids, finished)
    good, bad = calls.finish()
    assert not any(isinstance(p, Words) and p.text.strip() for p in pieces), pieces
    started = [p for p in pieces if isinstance(p, CallStarted)]
    assert [s.call_id for s in started[: len(good)]] == [c.call_id for c in good]
    for call in good:
        streamed = "".join(
            p.delta for p in pieces if isinstance(p, CallArguments) and p.index == good.index(call)
        )
        assert streamed == call.arguments
    return good, bad


@module_loop
async def test_a_random_model_makes_schema_valid_calls_when_they_are_required(
    engine: VllmEngine,
) -> None:
    """Random weights and tool_choice required, or a named function: vLLM's structured
    outputs hold the call to a tool's name and its arguments to the tool's schema."""
    import jsonschema

    schema = json.loads(WEATHER.parameters)
    for tools in (
        Tools([WEATHER], "required"),
        Tools([WEATHER, CLOCK], "function", "get_weather"),
        Tools([WEATHER, CLOCK], "required", parallel=False),
    ):
        good, bad = await _calls(engine, tools, f"tools-{tools.choice}-{tools.parallel}")
        assert good, bad
        # parallel calls go on until the token cap: only the last may be cut off there
        assert [b.index for b in bad] in ([], [len(good)]), bad
        if not tools.parallel:
            assert len(good) == 1 and not bad
        for call in good:
            assert call.name in {"get_weather", "get_time"}
            if call.name == "get_weather":
                jsonschema.validate(json.loads(call.arguments), schema)
    await _assert_idle(engine)


def test_the_one_call_a_reply_must_make_ends_with_its_json(engine: VllmEngine) -> None:
    """A model that goes on after the call's JSON (random weights; sampling that ignores its
    end): what follows is no part of the call, and the call is whole, so the reply stops."""
    tokenizer = engine.tokenizer
    calls = ToolCalls(
        Tools([WEATHER], "required"), MESSAGES, parser_class("hermes", tokenizer), tokenizer
    )
    pieces = []
    for text in ('{"city": "Par', 'is", "days": ', '1}\r garbage "}', " more", "}"):
        assert not calls.whole
        pieces += calls.feed(text, [0])
        if calls.whole:
            break
    streamed = "".join(p.delta for p in pieces if isinstance(p, CallArguments))
    assert streamed == '{"city": "Paris", "days": 1}' and calls.whole
    good, bad = calls.finish()
    assert [json.loads(c.arguments) for c in good] == [{"city": "Paris", "days": 1}] and not bad


def test_calls_the_model_got_wrong_are_reported_not_made(engine: VllmEngine) -> None:
    """The hermes parser on written output: words before a call are words; a call of no such
    tool, one cut off mid-arguments and a second one with parallel calls off are bad."""
    tokenizer = engine.tokenizer
    parser = parser_class("hermes", tokenizer, strict="auto")

    def run(tools: Tools, output: str) -> tuple[list, list, list]:
        calls = ToolCalls(tools, MESSAGES, parser, tokenizer)
        ids = tokenizer.encode(output)
        pieces = []
        for i, token in enumerate(ids):  # a token at a time, as the engine streams them
            pieces += calls.feed(tokenizer.decode([token]), [token], i == len(ids) - 1)
        return pieces, *calls.finish()

    pieces, good, bad = run(
        Tools([WEATHER]),
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 1}}\n</tool_call>',
    )
    said = "".join(p.text for p in pieces if isinstance(p, Words))
    assert said.strip() == "Let me check." and [c.name for c in good] == ["get_weather"]
    assert json.loads(good[0].arguments) == {"city": "Paris", "days": 1} and not bad

    pieces, good, bad = run(
        Tools([WEATHER]), '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    )
    assert not good and "not one of the tools" in bad[0].reason
    assert not any(isinstance(p, CallStarted) for p in pieces)  # never announced

    _, good, bad = run(
        Tools([WEATHER]), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    )
    assert not good and "not JSON" in bad[0].reason

    two = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    _, good, bad = run(Tools([CLOCK], parallel=False), two)
    assert len(good) == 1 and "parallel_tool_calls" in bad[0].reason


def test_the_tool_template_is_the_models_own_or_the_builtin_chatml_one(tmp_path: Path) -> None:
    assert tool_chat_template(None, "{{ tools }} {{ messages }}") is None
    assert "<tool_call>" in (tool_chat_template(None, "<|im_start|>{{ messages }}") or "")
    with pytest.raises(ToolTemplateError, match=r"reasoning\.tools\.chat_template"):
        tool_chat_template(None, "[INST] {{ messages }}")
    with pytest.raises(ToolTemplateError, match="no built-in"):
        tool_chat_template("builtin:nope", None)
    own = tmp_path / "t.jinja"
    own.write_text("{{ tools }}")
    assert tool_chat_template(str(own), None) == "{{ tools }}"
