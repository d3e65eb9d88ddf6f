"""SNAC codes from talker tokens, and the streaming decoder: windows of frames give the audio a
whole-utterance decode gives, block edges included. SNAC 24 kHz's real configuration with
random weights (nothing can be downloaded here); its noise blocks are off where outputs are
compared, since they add fresh noise on every pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.backends.snac_codec import (
    SNAC_24KHZ,
    TOKENS_PER_FRAME,
    CodeLayout,
    SnacDecoder,
    Window,
    _fold_weight_norm,
    frames_of,
    load_snac,
)
from stages.backends.speech import SpeechModelNotFoundError, SpeechOptionError
from stages.backends.tiny_talker import ensure_snac

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def quiet_decoder() -> SnacDecoder:
    from snac import SNAC

    torch.manual_seed(0)
    model = SNAC(**{**SNAC_24KHZ, "noise": False}).eval()
    _fold_weight_norm(model)
    return SnacDecoder(model, torch.device("cpu"), False, "snac-24khz (no noise)")


def test_layout_reads_orpheus_tokens_as_codes_of_their_position() -> None:
    layout = CodeLayout()
    # the i-th audio token of a frame is offset + i * 4096 + code
    frame = [layout.offset + i * 4096 + code for i, code in enumerate([5, 6, 7, 8, 9, 10, 4095])]
    tokens = [128257, *frame, 128258, 17]  # start of speech, a frame, end of speech, a text token
    assert layout.codes(tokens) == [5, 6, 7, 8, 9, 10, 4095]
    assert list(layout.audio_token_ids())[:1] == [128266] and layout.end == 128266 + 7 * 4096
    frames = frames_of(layout.codes(frame * 2 + frame[:3]))
    assert frames.shape == (2, TOKENS_PER_FRAME)  # the partial third frame waits


@pytest.mark.parametrize("first_ahead", [1, 0])
def test_streamed_windows_match_a_whole_decode(quiet_decoder: SnacDecoder, first_ahead) -> None:
    frames = np.random.default_rng(0).integers(0, 4096, (20, TOKENS_PER_FRAME))
    (whole,) = quiet_decoder.decode([Window(frames, 0, len(frames))])
    assert len(whole) == 20 * quiet_decoder.frame_samples == 20 * 2048

    # the talker's defaults: 1 frame first, then 4, one frame of context and of lookahead
    # (the first block's lookahead `first_ahead`: 0 is the talker's first_lookahead_frames 0,
    # 0.6% rms here against 0.14%, the error in the first frame's last milliseconds)
    blocks, start = [], 0
    while start < len(frames):
        want = 1 if start == 0 else 4
        emit = min(want, len(frames) - start)
        first = max(0, start - 1)
        end = min(len(frames), start + want + (first_ahead if start == 0 else 1))
        blocks.append(Window(frames[first:end], start - first, emit))
        start += emit
    streamed = np.concatenate(quiet_decoder.decode(blocks))  # decoded as one batch per shape

    assert streamed.shape == whole.shape
    rms = np.sqrt(np.mean((streamed - whole) ** 2) / np.mean(whole**2))
    assert rms < 0.01, f"streamed audio differs from the whole decode by {rms:.2%} rms"
    # without context and lookahead the block edges are wrong: the test can tell
    bare = np.concatenate(
        quiet_decoder.decode([Window(frames[i : i + 4], 0, 4) for i in range(0, 20, 4)])
    )
    assert np.sqrt(np.mean((bare - whole) ** 2) / np.mean(whole**2)) > 2 * rms


def test_a_batch_decodes_each_window_as_alone(quiet_decoder: SnacDecoder) -> None:
    rng = np.random.default_rng(1)
    windows = [Window(rng.integers(0, 4096, (6, 7)), 1, 4) for _ in range(3)]
    windows.append(Window(rng.integers(0, 4096, (2, 7)), 0, 1))
    together = quiet_decoder.decode(windows)
    alone = [quiet_decoder.decode([w])[0] for w in windows]
    assert [len(a) for a in together] == [4 * 2048] * 3 + [2048]
    for a, b in zip(together, alone, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_loads_a_folder_as_snac_reads_one(tmp_path, caplog) -> None:
    folder = ensure_snac(tmp_path / "snac")
    decoder = load_snac(str(folder), torch.device("cpu"))
    assert decoder.sample_rate == 24000 and decoder.frame_samples == 2048
    assert "RANDOM weights" in caplog.text
    (audio,) = decoder.decode([Window(np.zeros((2, 7), np.int64), 0, 2)])
    assert audio.dtype == np.float32 and len(audio) == 4096


def test_bad_codecs_are_named(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants

    # a hub id is looked up in the cache only: this machine reaches no hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SpeechModelNotFoundError, match="does not exist"):
        load_snac(str(tmp_path / "nowhere"), torch.device("cpu"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeechModelNotFoundError, match=r"no config\.json"):
        load_snac(str(tmp_path / "empty"), torch.device("cpu"))
    with pytest.raises(SpeechModelNotFoundError, match="not-a-snac-id"):
        load_snac("not-a-snac-id", torch.device("cpu"))
    folder = ensure_snac(tmp_path / "snac")
    with pytest.raises(SpeechOptionError, match="codec_dtype"):
        load_snac(str(folder), torch.device("cpu"), dtype="int8")
