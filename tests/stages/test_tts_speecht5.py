"""SpeechT5 + HiFi-GAN voice on a tiny random-weight checkpoint, loaded through the real loader.

Random weights speak static, so these tests check the audio's format and length, the speaker
embedding handling, cancellation between pieces and the loader's errors, not what it sounds like.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from stages.backends.speech import SpeechModelNotFoundError, SpeechOptionError
from stages.backends.tts_speecht5 import SpeechT5Voice, _pieces, load_speecht5

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

#: The tiny model never predicts "stop", so it speaks maxlenratio mel frames (16 ms) per token:
#: 4 gives roughly the length of real speech.
MAXLENRATIO = 4


@pytest.fixture(scope="module")
def voice(tiny_speecht5, one_torch_thread) -> SpeechT5Voice:
    return load_speecht5(
        str(tiny_speecht5.model), str(tiny_speecht5.vocoder), maxlenratio=MAXLENRATIO
    )


def test_speaks_a_phrase_in_small_int16_chunks(voice):
    text = "Hello, how can I help you today?"
    chunks = list(voice.synthesize(text))

    assert voice.sample_rate == 16000
    assert chunks and all(c.dtype == np.int16 and c.ndim == 1 and len(c) <= 1600 for c in chunks)
    audio = np.concatenate(chunks)
    assert 0.5 < len(audio) / voice.sample_rate < 5.0
    assert np.abs(audio).max() > 100, "the vocoder produced silence"


def test_loading_says_the_weights_and_speaker_are_made_up(tiny_speecht5, caplog):
    with caplog.at_level(logging.WARNING):
        loaded = load_speecht5(
            str(tiny_speecht5.model), str(tiny_speecht5.vocoder), maxlenratio=1, warmup=False
        )
    assert loaded.random_weights
    assert "speecht5 model" in caplog.text and "speecht5 vocoder" in caplog.text
    assert "RANDOM weights" in caplog.text
    assert "no speaker_embedding given" in caplog.text


def test_speaker_embedding_from_npy(tiny_speecht5, tmp_path):
    xvector = tmp_path / "speaker.npy"
    np.save(xvector, np.random.default_rng(1).standard_normal(512).astype(np.float32))
    loaded = load_speecht5(
        str(tiny_speecht5.model),
        str(tiny_speecht5.vocoder),
        speaker_embedding=str(xvector),
        maxlenratio=1,
        warmup=False,
    )
    assert sum(len(c) for c in loaded.synthesize("Hi there.")) > 0


def test_speaker_embedding_of_the_wrong_size_is_named(tiny_speecht5, tmp_path):
    xvector = tmp_path / "short.npy"
    np.save(xvector, np.zeros(256, dtype=np.float32))
    with pytest.raises(SpeechOptionError, match=r"short\.npy.*\(256,\).*512"):
        load_speecht5(str(tiny_speecht5.model), str(tiny_speecht5.vocoder), str(xvector))
    with pytest.raises(SpeechModelNotFoundError, match=r"missing\.npy"):
        load_speecht5(
            str(tiny_speecht5.model), str(tiny_speecht5.vocoder), str(tmp_path / "missing.npy")
        )


def test_long_text_is_spoken_in_pieces_and_closing_stops_between_them(voice, monkeypatch):
    spoken: list[str] = []
    speak = voice._speak

    def recording(piece: str) -> np.ndarray:
        spoken.append(piece)
        return speak(piece)

    monkeypatch.setattr(voice, "stream_steps", 0)  # whole phrases through generate_speech
    monkeypatch.setattr(voice, "_speak", recording)
    monkeypatch.setattr(voice, "max_tokens", 12)
    speech = voice.synthesize("one two three four five six seven eight nine ten eleven twelve")
    next(speech)
    speech.close()
    assert spoken == ["one two"]  # "three four" never synthesized


class StepCounter:
    """Counts the decoder's steps (calls of its wrapped decoder)."""

    def __init__(self, voice: SpeechT5Voice, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        inner = voice._model.speecht5.decoder.wrapped_decoder
        forward = inner.forward

        def counted(*args, **kwargs):
            self.steps += 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(inner, "forward", counted)


def test_streaming_yields_audio_long_before_the_phrase_is_made(voice, monkeypatch):
    text = "Hello, how can I help you today?"
    monkeypatch.setattr(voice, "stream_steps", 0)
    whole = np.concatenate(list(voice.synthesize(text)))
    monkeypatch.setattr(voice, "stream_steps", 4)
    counter = StepCounter(voice, monkeypatch)
    speech = voice.synthesize(text)
    first = next(speech)
    steps_at_first = counter.steps
    streamed = np.concatenate([first, *speech])
    assert len(first) > 0 and steps_at_first < counter.steps / 3
    # the same frames, vocoded in blocks: the same length, and as loud
    assert len(streamed) == len(whole)
    assert 0.5 < np.std(streamed.astype(float)) / np.std(whole.astype(float)) < 2.0


def test_closing_a_stream_stops_the_decoder(voice, monkeypatch):
    counter = StepCounter(voice, monkeypatch)
    speech = voice.synthesize("Hello, how can I help you today?")
    next(speech)
    at_close = counter.steps
    speech.close()
    tokens = voice._processor(
        text="Hello, how can I help you today?", return_tensors="pt"
    ).input_ids.shape[1]
    steps_if_run = tokens * MAXLENRATIO // voice._model.config.reduction_factor
    assert counter.steps == at_close < steps_if_run / 2


def test_pieces_cut_at_spaces_and_never_exceed_the_limit():
    text = "a quick brown fox " * 10 + "x" * 25
    pieces = list(_pieces(text, 12))
    assert all(0 < len(p) <= 12 for p in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
    assert list(_pieces("   ", 12)) == []


def test_missing_paths_are_named(tiny_speecht5, tmp_path):
    with pytest.raises(SpeechModelNotFoundError, match=r"speecht5 model.*no-such-tts"):
        load_speecht5(str(tmp_path / "no-such-tts"), str(tiny_speecht5.vocoder))
    with pytest.raises(SpeechModelNotFoundError, match=r"speecht5 vocoder.*no-such-vocoder"):
        load_speecht5(str(tiny_speecht5.model), str(tmp_path / "no-such-vocoder"))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"max_len_ratio": 4}, "'max_len_ratio'.*'maxlenratio'"),
        ({"threshold": 1.5}, "threshold=1.5"),
        ({"minlenratio": 5.0, "maxlenratio": 2.0}, "minlenratio=5.0 > maxlenratio=2.0"),
        ({"chunk_ms": 250}, "chunk_ms=250"),
        ({"device": "cuda:not-a-number"}, "device='cuda:not-a-number'"),
        ({"stream_priority": "urgent"}, "stream_priority='urgent'"),
    ],
)
def test_bad_options_are_named(tiny_speecht5, options, named):
    with pytest.raises(SpeechOptionError, match=named):
        load_speecht5(str(tiny_speecht5.model), str(tiny_speecht5.vocoder), **options)


def test_stop_ends_the_phrase_at_the_next_decoder_step(voice, monkeypatch):
    """What a CANCEL does through the vocoder's `stop`: no decoder step after it returns True,
    without waiting for the block in progress or for the consumer to close the stream."""
    monkeypatch.setattr(voice, "stream_steps", 4)
    counter = StepCounter(voice, monkeypatch)
    stopped = False
    speech = voice.synthesize("one two three four five six seven eight", stop=lambda: stopped)
    next(speech)
    steps_before = counter.steps
    stopped = True
    rest = list(speech)  # what was already vocoded of the block in hand, then the end
    assert counter.steps == steps_before
    assert sum(len(c) for c in rest) <= 4 * voice._model.config.reduction_factor * 256


def test_a_batch_speaks_each_phrase_as_it_is_spoken_alone(voice, monkeypatch):
    """Phrases of different lengths, joining a batch at different blocks, get the audio each
    gets alone, from one decoder pass per step for all of them."""
    # the prenet's dropout is on even at inference (SpeechT5 needs it): off, to compare
    prenet = voice._model.speecht5.decoder.prenet
    monkeypatch.setattr(prenet, "_consistent_dropout", lambda x, p: x)
    monkeypatch.setattr(voice, "stream_steps", 4)
    texts = ["Hello there.", "How can I help you today?", "Yes, of course."]
    alone = [np.concatenate(list(voice.synthesize(t))) for t in texts]

    counter = StepCounter(voice, monkeypatch)
    streams, spoken = [], [[] for _ in texts]
    for block in range(200):
        if block < len(texts):  # one more phrase joins at each of the first blocks
            streams.append(voice.begin(texts[block]))
        live = [s for s in streams if not s.done]
        if not live:
            break
        for stream, audio in zip(live, voice.advance(live), strict=True):
            spoken[streams.index(stream)].append(audio)
    together = [np.concatenate(parts) for parts in spoken]

    for one, batched in zip(alone, together, strict=True):
        assert len(batched) == len(one) > 0
        assert np.abs(batched.astype(int) - one.astype(int)).max() <= 2
    longest = max(len(voice._processor(text=t).input_ids) for t in texts)
    steps_alone = longest * MAXLENRATIO // voice._model.config.reduction_factor
    assert counter.steps < steps_alone + 2 * len(texts) + 4  # not one pass per phrase per step


def test_bfloat16_voice_speaks_alone_and_batched_as_long_as_float32(tiny_speecht5, voice):
    """The GPU layouts can run SpeechT5 in bfloat16: masks, caches and HiFi-GAN follow the
    model's dtype, and the audio has float32's length (random weights: not its samples)."""
    half = load_speecht5(
        str(tiny_speecht5.model),
        str(tiny_speecht5.vocoder),
        maxlenratio=MAXLENRATIO,
        dtype="bfloat16",
    )
    assert half._model.dtype == torch.bfloat16
    texts = ["Hello there.", "How can I help you today?"]
    for text in texts:
        audio = np.concatenate(list(half.synthesize(text)))
        assert len(audio) == len(np.concatenate(list(voice.synthesize(text))))
        assert np.abs(audio).max() > 100, "the bfloat16 vocoder produced silence"
    streams = [half.begin(t) for t in texts]
    spoken: list[list[np.ndarray]] = [[] for _ in texts]
    for _ in range(200):
        live = [s for s in streams if not s.done]
        if not live:
            break
        for stream, audio in zip(live, half.advance(live), strict=True):
            spoken[streams.index(stream)].append(audio)
    for text, parts in zip(texts, spoken, strict=True):
        audio = np.concatenate(parts)
        assert len(audio) == len(np.concatenate(list(voice.synthesize(text))))
        assert audio.dtype == np.int16 and np.abs(audio).max() > 100
