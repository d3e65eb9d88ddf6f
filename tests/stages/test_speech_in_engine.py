"""Speech-in on a real vLLM engine (the CPU build), for each family (tiny random-weight
Qwen2.5-Omni thinker and Ultravox): the language model served alone, a turn's rows as
`prompt_embeds`, prefilled window by window as it is spoken, and found in the prefix cache when
the turn ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch

from stages.backends.llm_vllm import PromptUsage, VllmEngine
from stages.backends.speech_in import SpeechInModel, load_speech_in
from stages.backends.tiny_speech_in import ensure_tiny_omni, ensure_tiny_ultravox
from stages.speech_in import EmbeddedPrompt
from tests.stages.test_speech_in import speech

pytestmark = [
    pytest.mark.usefixtures("model_cache"),  # tests/stages/conftest.py
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# blocks of 32 positions (the CPU's smallest), so that a few windows fill several
ENGINE_ARGS = {
    "enable_prompt_embeds": True,
    "block_size": 32,
    "max_model_len": 1024,
    "max_num_seqs": 4,
    "kv_cache_memory_bytes": 64 << 20,
}
SAMPLING = {"max_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module", params=["omni", "ultravox"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Each family's tiny model, in turn."""
    ensure = ensure_tiny_omni if request.param == "omni" else ensure_tiny_ultravox
    return load_speech_in(str(ensure(tmp_path_factory.mktemp("m") / request.param)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model: SpeechInModel) -> AsyncIterator[VllmEngine]:
    engine = await VllmEngine.start(model.language_model(), ENGINE_ARGS, SAMPLING)
    yield engine
    engine.shutdown()


def windows(model: SpeechInModel, seconds: int, seed: int) -> list[torch.Tensor]:
    tower = model.tower("cpu", "bfloat16")
    audio = speech(float(seconds), seed)
    size = tower.window_samples
    return [
        torch.from_numpy(tower.rows(audio[i : i + size]).view("int16")).view(torch.bfloat16)
        for i in range(0, len(audio), size)
    ]


def messages(rows: torch.Tensor) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful voice assistant."},
        {"role": "user", "content": "", "audio": rows, "turn_id": 1},
    ]


async def reply(engine: VllmEngine, request_id: str, prompt: dict) -> tuple[str, PromptUsage]:
    usage, text = PromptUsage(), ""
    async for piece, _, _ in engine.generate_prompt(request_id, prompt, None, usage):
        text += piece
    return text, usage


async def test_a_turn_prefilled_as_it_is_spoken_is_found_cached_and_answered_the_same(
    model: SpeechInModel, engine: VllmEngine
) -> None:
    embedded = EmbeddedPrompt(engine.tokenizer, model.layout, engine.hidden_size, torch.bfloat16)
    turn = windows(model, 6, seed=3)  # three windows or more: 150 rows of Omni, 75 of Ultravox
    whole = embedded.render(messages(torch.cat(turn)))
    cold_text, cold = await reply(engine, "cold", whole)
    assert cold.cached_tokens == 0 and cold.prompt_tokens == len(whole["prompt_token_ids"])
    assert cold.output_tokens == SAMPLING["max_tokens"] and cold_text

    await engine.reset_prefix_cache()  # as if the turn had never been seen
    for k in range(1, len(turn)):  # the windows as they come, but the last
        opened = embedded.render(messages(torch.cat(turn[:k])), open_turn=True)
        await engine.prefill(f"prefill-{k}", opened)
    started = time.monotonic()
    warm_text, warm = await reply(engine, "warm", whole)
    took_ms = 1000 * (time.monotonic() - started)
    print(f"\nreply: {warm.cached_tokens} of {warm.prompt_tokens} cached, {took_ms:.0f} ms")
    # every full block of the turn so far was cached: only the last window and the rest left
    assert warm.cached_tokens >= warm.prompt_tokens - len(turn[-1]) - 2 * 32
    assert warm.cached_tokens % 32 == 0
    assert warm_text == cold_text  # the same prompt, the same greedy reply


async def test_a_prefill_cancelled_mid_way_leaves_no_blocks_held(
    model: SpeechInModel, engine: VllmEngine
) -> None:
    embedded = EmbeddedPrompt(engine.tokenizer, model.layout, engine.hidden_size, torch.bfloat16)
    opened = embedded.render(messages(torch.cat(windows(model, 8, seed=5))), open_turn=True)
    task = asyncio.ensure_future(engine.prefill("prefill-cancelled", opened))
    await asyncio.sleep(0)  # on its way to the engine
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await engine.wait_kv_idle(timeout=5.0) == 0.0
