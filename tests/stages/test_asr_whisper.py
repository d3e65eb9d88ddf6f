"""Whisper recognizer on a tiny random-weight checkpoint, loaded through the real loader.

The weights are random, so the transcripts are noise: these tests check the streaming mechanics
(when it re-decodes, what it returns, cancel, long turns) and the loader's errors, not accuracy.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from stages.backends.asr_whisper import WhisperRecognizer, load_whisper
from stages.backends.speech import (
    SpeechModelNotFoundError,
    SpeechOptionError,
    StreamClosedError,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

#: Random weights never stop on their own; a short cap keeps each decode around 50 ms.
MAX_NEW_TOKENS = 8


def chunks_of(pcm16: np.ndarray, samples: int = 3200) -> Iterator[np.ndarray]:
    """The gateway's 200 ms chunks."""
    for start in range(0, len(pcm16), samples):
        yield pcm16[start : start + samples]


def count_decodes(recognizer: WhisperRecognizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of the audio of every decode the recognizer runs."""
    lengths: list[int] = []
    transcribe = recognizer.transcribe

    def counting(pcm16: np.ndarray) -> str:
        lengths.append(len(pcm16))
        return transcribe(pcm16)

    monkeypatch.setattr(recognizer, "transcribe", counting)
    return lengths


@pytest.fixture(scope="module")
def recognizer(tiny_whisper, one_torch_thread) -> WhisperRecognizer:
    return load_whisper(str(tiny_whisper), partial_interval_ms=400, max_new_tokens=MAX_NEW_TOKENS)


def test_loads_from_a_local_folder_and_says_the_weights_are_random(tiny_whisper, caplog):
    with caplog.at_level(logging.WARNING, logger="stages.backends.speech"):
        loaded = load_whisper(str(tiny_whisper), max_new_tokens=MAX_NEW_TOKENS, warmup=False)
    assert loaded.random_weights
    assert "RANDOM weights" in caplog.text
    assert loaded.name == "whisper" and loaded.sample_rate == 16000


def test_streams_partials_at_the_interval_and_a_final(recognizer, make_speech, monkeypatch):
    speech = make_speech("this is a test of the speech recognizer")
    decodes = count_decodes(recognizer, monkeypatch)
    stream = recognizer.open_stream()
    partials = [p for chunk in chunks_of(speech.pcm16) if (p := stream.feed(chunk)) is not None]
    final = stream.finish()

    interval = 16000 * 400 // 1000
    assert len(decodes) == len(speech.pcm16) // interval + 1  # every 400 ms, plus the final
    assert decodes[-1] == len(speech.pcm16)  # the final sees the whole turn
    assert partials and all(isinstance(p, str) and p for p in partials)
    assert all(a != b for a, b in itertools.pairwise(partials))
    assert isinstance(final, str)


def test_no_partials_when_the_interval_is_zero(tiny_whisper, monkeypatch):
    quiet = load_whisper(str(tiny_whisper), partial_interval_ms=0, max_new_tokens=4, warmup=False)
    decodes = count_decodes(quiet, monkeypatch)
    stream = quiet.open_stream()
    noise = np.random.default_rng(0).integers(-3000, 3000, 16000, dtype=np.int16)
    assert [stream.feed(chunk) for chunk in chunks_of(noise)] == [None] * 5
    stream.finish()
    assert decodes == [16000]


def test_cancel_drops_the_turn_without_decoding(recognizer, monkeypatch):
    decodes = count_decodes(recognizer, monkeypatch)
    stream = recognizer.open_stream()
    stream.feed(np.zeros(3200, dtype=np.int16))
    stream.close()
    stream.close()  # idempotent
    with pytest.raises(StreamClosedError):
        stream.feed(np.zeros(3200, dtype=np.int16))
    with pytest.raises(StreamClosedError):
        stream.finish()
    assert decodes == []
    assert recognizer.open_stream().finish() == ""  # an empty turn is not decoded either
    assert decodes == []


def test_a_turn_longer_than_a_window_is_decoded_window_by_window(tiny_whisper, monkeypatch):
    quiet = load_whisper(str(tiny_whisper), partial_interval_ms=0, max_new_tokens=4, warmup=False)
    decodes = count_decodes(quiet, monkeypatch)
    stream = quiet.open_stream()
    window = quiet.window_samples
    for chunk in chunks_of(np.zeros(window + 16000, dtype=np.int16), 16000):
        stream.feed(chunk)
    assert isinstance(stream.finish(), str)
    assert decodes == [window, 16000]


def test_feed_rejects_float_audio(recognizer):
    stream = recognizer.open_stream()
    with pytest.raises(TypeError, match="int16"):
        stream.feed(np.zeros(3200, dtype=np.float32))
    stream.close()


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-whisper"
    with pytest.raises(SpeechModelNotFoundError, match=r"no-such-whisper.*does not exist"):
        load_whisper(str(missing))


def test_folder_without_a_model_is_named(tmp_path):
    with pytest.raises(SpeechModelNotFoundError, match=r"no config\.json"):
        load_whisper(str(tmp_path))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"partial_intervall_ms": 300}, "'partial_intervall_ms'.*'partial_interval_ms'"),
        ({"partial_interval_ms": -1}, "partial_interval_ms=-1"),
        ({"task": "summarize"}, "task='summarize'"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"device": "tpu:x"}, "device='tpu:x'"),
        ({"language": "klingon", "warmup": False}, "language='klingon'"),
        ({"stream_priority": "urgent"}, "stream_priority='urgent'"),
        ({"decode_loop": "beam"}, "decode_loop='beam'"),
        ({"language": None}, "language=None.*decode_loop='generate'"),
    ],
)
def test_bad_options_are_named(tiny_whisper, options, named):
    with pytest.raises(SpeechOptionError, match=named):
        load_whisper(str(tiny_whisper), **options)


def test_decodes_asked_for_together_run_as_one_batch(recognizer, make_speech, monkeypatch):
    """Turns of several callers that end together are decoded in one batch, each
    getting its own transcript (the same as decoding it alone)."""
    words = ["hello there", "good morning", "what time is it", "thank you very much"]
    clips = [make_speech(w).pcm16 for w in words]
    alone = [recognizer.transcribe(c) for c in clips]

    batches: list[int] = []
    decode = recognizer._greedy.decode
    gate = threading.Event()

    def counting(features):
        batches.append(len(features))
        gate.wait(10)  # hold the first decode so that the others queue behind it
        return decode(features)

    monkeypatch.setattr(recognizer._greedy, "decode", counting)
    results: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, recognizer.transcribe(clips[i])))
        for i in range(len(clips))
    ]
    threads[0].start()
    for _ in range(500):
        if batches:
            break
        threading.Event().wait(0.01)
    for t in threads[1:]:
        t.start()
    for _ in range(500):  # the other three are waiting for the model
        if len(recognizer._waiting) == 3:
            break
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join(30)
    assert batches == [1, 3]
    assert [results[i] for i in range(len(clips))] == alone


def test_peek_transcribes_the_turn_so_far_and_leaves_it_open(recognizer, make_speech, monkeypatch):
    speech = make_speech("tell me something nice")
    decodes = count_decodes(recognizer, monkeypatch)
    stream = recognizer.open_stream()
    stream.feed(speech.pcm16[:16000])
    before = len(decodes)  # partials so far
    early = stream.peek()
    assert decodes[before:] == [16000]  # one decode of the turn so far
    stream.feed(speech.pcm16[16000:])  # still open
    final = stream.finish()
    assert decodes[-1] == len(speech.pcm16)
    assert early == recognizer.transcribe(speech.pcm16[:16000])
    assert final == recognizer.transcribe(speech.pcm16)
    with pytest.raises(StreamClosedError):
        stream.peek()


def test_peek_hears_the_turn_with_the_silence_to_come(recognizer, make_speech, monkeypatch):
    """At a pause the turn is transcribed with as much silence after it as the turn will end
    with, so that its words are the ones the whole turn gets."""
    speech = make_speech("tell me something nice")
    decodes = count_decodes(recognizer, monkeypatch)
    stream = recognizer.open_stream()
    stream.feed(speech.pcm16)
    early = stream.peek(silence_after=6720)
    assert decodes[-1] == len(speech.pcm16) + 6720
    stream.feed(np.zeros(6720, np.int16))
    assert stream.finish() == early


@pytest.mark.parametrize("loop", ["greedy", "static"])
def test_greedy_decoding_says_what_generate_says(tiny_whisper, make_speech, loop):
    """The lean loops (stages.backends.whisper_greedy and whisper_static) against transformers'
    generate(), token for token, on a batch of different windows (padded to 4 for static)."""
    import torch

    greedy = load_whisper(str(tiny_whisper), max_new_tokens=12, decode_loop=loop, warmup=False)
    generate = load_whisper(str(tiny_whisper), max_new_tokens=12, decode_loop="generate")
    assert generate._greedy is None
    clips = [make_speech(w).pcm16 for w in ("hello there", "what time is it", "thank you")]
    clips.append(np.zeros(8000, np.int16))
    extractor = greedy._processor.feature_extractor
    features = extractor(
        [c.astype(np.float32) / 32768 for c in clips], sampling_rate=16000, return_tensors="pt"
    ).input_features
    with torch.inference_mode():
        ours = greedy._greedy.decode(features)
        theirs = generate._model.generate(
            features, generation_config=generate._generation_config, **generate._generate_kwargs
        )
    assert ours.shape == (len(clips), 12)
    assert torch.equal(ours, theirs[:, -12:])
    assert [greedy.transcribe(c) for c in clips] == [generate.transcribe(c) for c in clips]


@pytest.mark.parametrize("loop", ["greedy", "static"])
def test_greedy_decoding_stops_where_generate_stops(tiny_whisper, make_speech, loop):
    """A window that says end-of-text: padded after it as generate() pads it, and the loop
    ends once every window has ended. (Random weights never say it, so end-of-text is made
    the token they say first.)"""
    import copy

    import torch

    from stages.backends.whisper_greedy import STOP_CHECK_STEPS, GreedyDecoder
    from stages.backends.whisper_static import StaticDecoder

    decoder = {"greedy": GreedyDecoder, "static": StaticDecoder}[loop]

    recognizer = load_whisper(str(tiny_whisper), max_new_tokens=12, warmup=False)
    model, config = recognizer._model, copy.deepcopy(recognizer._generation_config)
    clips = [make_speech(w).pcm16 for w in ("hello there", "what time is it")]
    features = recognizer._processor.feature_extractor(
        [c.astype(np.float32) / 32768 for c in clips], sampling_rate=16000, return_tensors="pt"
    ).input_features
    with torch.inference_mode():
        first = recognizer._greedy.decode(features)[0, 0].item()
        config.eos_token_id = first
        ours = decoder(model, config, "en", "transcribe").decode(features)
        theirs = model.generate(features, generation_config=config, language="en")
    said = theirs.shape[1]  # generate() cuts every window's end-of-text and pads
    assert said < 12 and ours[0, 0] == config.pad_token_id  # the first window ended at once
    assert ours.shape[1] == STOP_CHECK_STEPS * -(-max(said, 1) // STOP_CHECK_STEPS)
    assert torch.equal(ours[:, :said], theirs)
    assert bool((ours[:, said:] == config.pad_token_id).all())


def test_static_buffers_serve_batches_of_any_size_one_after_another(tiny_whisper, make_speech):
    """A batch of 3 (padded to 4), then each window alone in the same buffers: the same tokens,
    whatever an earlier, longer batch left behind."""
    import torch

    recognizer = load_whisper(str(tiny_whisper), decode_loop="static", warmup=False)
    clips = [make_speech(w).pcm16 for w in ("good morning", "how are you", "see you")]
    features = recognizer._processor.feature_extractor(
        [c.astype(np.float32) / 32768 for c in clips], sampling_rate=16000, return_tensors="pt"
    ).input_features
    with torch.inference_mode():
        together = recognizer._greedy.decode(features)
        alone = [recognizer._greedy.decode(features[i : i + 1]) for i in range(3)]
    assert torch.equal(together, torch.cat(alone))


def test_static_steps_are_recorded_for_every_batch_size_before_the_first_turn(
    tiny_whisper, make_speech, monkeypatch
):
    """What `record_steps` does on CUDA, with the recording stood in for (no GPU here): the
    buffers sized for max_batch once, a step recorded per batch size, none during decodes."""
    import torch

    from stages.backends.whisper_static import StaticDecoder

    recorded: list[int] = []

    class Replay:  # replays a step by running it, as the recorded graph would
        def __init__(self, decoder: StaticDecoder, size: int) -> None:
            self.decoder, self.size = decoder, size

        def replay(self) -> None:
            self.decoder._logits[self.size] = self.decoder._forward(self.size)

    def capture(self: StaticDecoder, size: int) -> Replay:
        recorded.append(size)
        return Replay(self, size)

    monkeypatch.setattr(StaticDecoder, "_capture", capture)
    recognizer = load_whisper(
        str(tiny_whisper), decode_loop="static", max_batch=5, max_new_tokens=6, warmup=False
    )
    reference = load_whisper(str(tiny_whisper), decode_loop="greedy", max_new_tokens=6)
    recognizer._greedy._graphed = True
    recognizer.record_steps()
    assert recorded == [1, 2, 4, 8] and recognizer._greedy._capacity == 8
    clips = [make_speech(w).pcm16 for w in ("good morning", "how are you", "see you")]
    features = recognizer._processor.feature_extractor(
        [c.astype(np.float32) / 32768 for c in clips], sampling_rate=16000, return_tensors="pt"
    ).input_features
    with torch.inference_mode():
        assert torch.equal(recognizer._greedy.decode(features), reference._greedy.decode(features))
        recognizer._greedy.decode(features[:1])
    assert recorded == [1, 2, 4, 8]  # nothing recorded while decoding
