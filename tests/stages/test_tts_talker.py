"""The talker voice on the CPU: vLLM serving a tiny random-weight talker of Orpheus's layout,
and SNAC 24 kHz (random weights) decoding its codes as they come, through the real loaders.

Random weights speak noise, so these tests check what the stage relies on: audio streamed in
small int16 chunks, a phrase's length bounded by its text, phrases of several callers decoded in
one batch, aborts that free the KV cache (and stop only the streams they should), and clear
errors for bad options.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from stages.backends.snac_codec import TOKENS_PER_FRAME
from stages.backends.speech import SpeechOptionError
from stages.backends.tiny_talker import ensure_snac, ensure_tiny_talker
from stages.backends.tts_talker import TalkerVoice, load_talker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("one_torch_thread"),
]

FRAMES_PER_CHAR = 0.5  # a random talker never ends a phrase: this bounds it


def frames_of_text(text: str) -> int:
    """The frames a random talker speaks for ``text``: its bound, at least min_frames (4)."""
    return max(4, int(np.ceil(len(text) * FRAMES_PER_CHAR)))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("talker")
    return str(ensure_tiny_talker(root / "talker")), str(ensure_snac(root / "snac"))


@pytest.fixture(scope="module")
def voice(models, one_torch_thread):
    talker = load_talker(
        *models,
        max_frames_per_char=FRAMES_PER_CHAR,
        engine_args={"kv_cache_memory_bytes": 128 << 20, "max_model_len": 1024},
    )
    yield talker
    talker.close()


def wait_idle(voice: TalkerVoice, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while voice.engine.num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert voice.engine.num_unfinished_requests() == 0


def test_speaks_a_phrase_in_small_chunks_bounded_by_its_text(voice: TalkerVoice) -> None:
    text = "Hello, how can I help you today?"
    chunks = list(voice.synthesize(text))

    assert voice.sample_rate == 24000
    assert chunks and all(c.dtype == np.int16 and c.ndim == 1 and len(c) <= 2400 for c in chunks)
    audio = np.concatenate(chunks)
    frames = frames_of_text(text)
    # every frame the talker made, the last ones too (no lookahead is left at the end)
    assert len(audio) == frames * 2048
    assert np.abs(audio).max() > 100, "the codec produced silence"
    wait_idle(voice)


def test_prompt_is_orpheus_layout_around_voice_and_text(voice: TalkerVoice) -> None:
    ids = voice.prompt_ids("Hi there.")
    assert ids[0] == 128259 and ids[-4:] == [128009, 128260, 128261, 128257]
    assert voice.tokenizer.decode(ids[1:-4]) == "tara: Hi there."


def test_streams_of_several_callers_advance_in_one_batch(voice: TalkerVoice) -> None:
    texts = ["One small phrase.", "Another phrase, a bit longer than that.", "Third."]
    streams = [voice.begin(t) for t in texts]
    audio: list[list[np.ndarray]] = [[] for _ in texts]
    first_at: list[float | None] = [None] * len(texts)
    t0 = time.monotonic()
    deadline = t0 + 60
    while not all(s.done for s in streams) and time.monotonic() < deadline:
        for i, block in enumerate(voice.advance(streams)):
            if len(block):
                audio[i].append(block)
                first_at[i] = first_at[i] or time.monotonic() - t0
    assert all(s.done for s in streams)
    for text, blocks in zip(texts, audio, strict=True):
        assert len(np.concatenate(blocks)) == frames_of_text(text) * 2048
    # the first block of each is one frame: it comes before the longest phrase is made
    assert all(len(blocks[0]) == 2048 for blocks in audio)
    print(f"\nfirst audio of 3 phrases begun together: {[round(t, 3) for t in first_at]} s")
    wait_idle(voice)


def test_closing_a_stream_aborts_its_request(voice: TalkerVoice) -> None:
    stream = voice.begin("A long phrase that would take many frames to speak out loud. " * 3)
    deadline = time.monotonic() + 30
    while not stream.tokens and time.monotonic() < deadline:
        voice.advance([stream])
    assert stream.tokens and voice.engine.num_unfinished_requests() == 1
    stream.close()
    wait_idle(voice)
    assert voice.engine.kv_usage() == 0.0 or voice.engine.num_unfinished_requests() == 0
    made = len(stream.tokens)
    assert made < len(stream.codes) + 7 * int(200 * FRAMES_PER_CHAR), "it ran to its end"


def test_abort_stopped_aborts_only_the_cancelled_sessions_streams(voice: TalkerVoice) -> None:
    cancelled = threading.Event()
    cut = voice.begin("This caller is about to be interrupted. " * 3, stop=cancelled.is_set)
    other = voice.begin("This caller goes on speaking to the end.")
    deadline = time.monotonic() + 30
    while not (cut.tokens and other.tokens) and time.monotonic() < deadline:
        voice.advance([cut, other])
    usage_before = voice.engine.kv_usage()
    cancelled.set()  # the session's epoch moved on: its stop() says so
    confirmed: list[tuple[float | None, str]] = []
    done = threading.Event()

    def then(kv: float | None) -> None:
        confirmed.append((kv, threading.current_thread().name))
        done.set()

    t0 = time.monotonic()
    voice.abort_stopped(then)
    returned_ms = (time.monotonic() - t0) * 1000
    assert cut.done and not other.done  # stopped at once, before the engine confirms
    assert done.wait(5), "the abort was never confirmed"
    took_ms = (time.monotonic() - t0) * 1000
    [(kv, thread)] = confirmed
    print(f"\nabort_stopped returned in {returned_ms:.1f} ms, confirmed in {took_ms:.1f} ms,")
    print(f"KV usage {usage_before:.4f} -> {kv}")
    assert kv is not None and kv <= usage_before
    assert thread == "talker-loop"  # confirmed on the engine's loop, not the caller's thread

    blocks = []
    while not other.done and time.monotonic() < deadline:
        blocks += [b for b in voice.advance([cut, other])[1:] if len(b)]
    assert other.done and len(np.concatenate(blocks)) > 0
    wait_idle(voice)
    made = len(cut.tokens)
    assert made < TOKENS_PER_FRAME * int(len("This caller is about to be interrupted. " * 3) * 0.5)


def test_a_cancel_the_engine_saw_first_acks_its_blocks_freed(voice: TalkerVoice) -> None:
    """The session's epoch moves before its CANCEL is read: the engine's loop sees `stop()`
    at its next step and aborts the request itself, so the CANCEL finds nothing left to stop.
    The ack still waits for that abort to be applied and says no KV block is held (an engine
    left idle sends no stats record after it)."""
    cancelled = threading.Event()
    stream = voice.begin("This caller is about to be interrupted. " * 3, stop=cancelled.is_set)
    deadline = time.monotonic() + 30
    while not stream.tokens and time.monotonic() < deadline:
        voice.advance([stream])
    assert voice.engine.kv_usage() > 0.0
    cancelled.set()
    with voice._new_tokens:  # notified when the engine's loop ends the request at its next step
        noticed = voice._new_tokens.wait_for(lambda: stream.finished, timeout=30)
    assert noticed, "the engine never noticed the stop"
    confirmed: list[float | None] = []
    done = threading.Event()

    def then(kv: float | None) -> None:
        confirmed.append(kv)
        done.set()

    voice.abort_stopped(then)
    assert done.wait(5), "the ack never came"
    assert confirmed == [0.0]
    wait_idle(voice)


def test_warming_up_batches_speaks_every_group_to_its_end(voice: TalkerVoice) -> None:
    """Groups of 1, 2 and 3 phrases (the last capped at `most`), each spoken out; nothing
    is left running in the engine, and the voice speaks as before."""
    before = next(voice._ids)
    voice.warm_up_batches(3)
    assert next(voice._ids) - before - 1 == 1 + 2 + 3
    assert not voice._live
    wait_idle(voice)
    assert len(np.concatenate(list(voice.synthesize("Still here.")))) > 0


def test_a_first_block_without_lookahead_goes_out_a_frame_sooner(voice: TalkerVoice) -> None:
    """`first_lookahead_frames` 0: a phrase's first frame is decoded as soon as its 7 tokens
    are in; with the default it waits for the next frame. Later blocks keep their lookahead."""
    from stages.backends.tts_talker import TalkStream

    frame = [voice.layout.offset + i * 4096 + 100 for i in range(TOKENS_PER_FRAME)]
    stream = TalkStream("by-hand", lambda: False)
    stream.tokens = list(frame)
    assert voice.lookahead_frames == voice.first_lookahead_frames == 1
    assert voice._window(stream) is None  # one frame made: the default waits for a second
    voice.first_lookahead_frames = 0
    try:
        window = voice._window(stream)
        assert window is not None and window.emit == 1 and len(window.frames) == 1
        assert sorted(voice.window_sizes()) == [1, 6]  # no lookahead first; 1 + 4 + 1 later
        stream.emitted = 1
        stream.tokens += frame * 4  # four more frames: a later block still waits for its fifth
        assert voice._window(stream) is None
    finally:
        voice.first_lookahead_frames = 1


def test_bad_options_are_named(models) -> None:
    with pytest.raises(SpeechOptionError, match="unknown talker option 'frames'"):
        load_talker(*models, frames=2)
    with pytest.raises(SpeechOptionError, match="stream_frames=0"):
        load_talker(*models, stream_frames=0)
    with pytest.raises(SpeechOptionError, match="max_frames_per_char"):
        load_talker(*models, max_frames_per_char=100)
    with pytest.raises(SpeechOptionError, match="warmup_streams=0"):
        load_talker(*models, warmup_streams=0)
    with pytest.raises(SpeechOptionError, match="first_lookahead_frames=-1"):
        load_talker(*models, first_lookahead_frames=-1)
