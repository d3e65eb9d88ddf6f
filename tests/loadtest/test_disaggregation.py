"""The disaggregation experiment's pieces: its figures from turn stamps (made-up times), and
the monolithic driver serving real turns in one process (pocketsphinx, vLLM on the tiny
model, the tiny random SpeechT5), on the loop and on a vocoder thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from loadtest.disaggregation import MonolithicPipeline, TurnTimes, experiment_config, mode_figures
from stages.backends.tiny_speech_models import ensure_tiny_speecht5

MS = 1_000_000
# torch 2.13 warns when vLLM imports torch.utils.mkldnn, which still uses torch.jit.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


def test_figures_time_tokens_per_turn_and_end_of_speech_to_first_audio() -> None:
    a = TurnTimes(speech_stopped=0, transcript=100 * MS, tokens=[150 * MS, 160 * MS, 190 * MS])
    a.first_audio = 400 * MS
    b = TurnTimes(speech_stopped=0, transcript=50 * MS, tokens=[60 * MS, 65 * MS])
    figures = mode_figures([a, b], wall_s=2.0)
    assert figures["deltas"] == 5
    # intervals within each turn only: 10, 30 and 5 ms, never b's first token after a's last
    assert figures["inter_token_ms"]["n"] == 3 and figures["inter_token_ms"]["max"] == 30
    assert figures["inter_token_ms"]["p50"] == 10
    assert figures["first_token_ms"]["p50"] == pytest.approx(30)
    assert figures["turn_ms"] == {"p50": 400.0, "p95": 400.0, "n": 1, "max": 400.0}
    assert figures["turns_with_audio"] == 1 and figures["turns"] == 2


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    import torch

    threads = torch.get_num_threads()  # the voice sets the process's torch threads to 1
    speecht5 = ensure_tiny_speecht5(tmp_path_factory.mktemp("models") / "tiny-speecht5")
    config = experiment_config(speecht5, max_tokens=12, sessions=2)
    config.encoder.options["pool_size"] = 1  # one decoder a turn at a time is enough here
    yield config
    torch.set_num_threads(threads)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pipeline(config) -> AsyncIterator[MonolithicPipeline]:
    mono = await MonolithicPipeline.start(config)
    try:
        yield mono
    finally:
        mono.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.asyncio(loop_scope="module")
async def test_monolithic_driver_hears_answers_and_speaks(pipeline, make_speech) -> None:
    speech = make_speech("what is the weather like today").pcm16
    first, second = [await pipeline.turn(s, speech, realtime=False) for s in (1, 2)]
    for t in (first, second):
        assert t.transcript_text  # pocketsphinx heard words
        # 12 tokens (ignore_eos) come as up to 12 deltas: vLLM merges what the loop is late for
        assert 0 < len(t.tokens) <= 12 and t.reply_text
        assert t.audio_samples > pipeline.sample_rate // 10  # the tiny voice spoke
        assert t.speech_stopped <= t.transcript <= t.tokens[0] <= t.first_audio <= t.done
    # the session remembers the exchange: the next turn's prompt holds both messages
    messages = pipeline.conversation(1).messages
    assert [m["role"] for m in messages] == ["user", "assistant"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.asyncio(loop_scope="module")
async def test_turns_of_two_sessions_run_at_once_with_the_vocoder_on_a_thread(
    pipeline, make_speech
) -> None:
    speech = make_speech("tell me something nice").pcm16
    pipeline.set_vocoder_thread(True)
    try:
        turns = await asyncio.gather(*(pipeline.turn(s, speech, realtime=False) for s in (3, 4)))
    finally:
        pipeline.set_vocoder_thread(False)
    assert all(t.first_audio and 0 < len(t.tokens) <= 12 and t.audio_samples for t in turns)
