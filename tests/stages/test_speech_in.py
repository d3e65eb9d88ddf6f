"""stages.backends.speech_in and stages.speech_in: the families' towers on windows, their
language models as vLLM serves them, and the prompts that carry a turn's rows, on tiny
random-weight checkpoints of Ultravox's and Qwen2.5-Omni's layouts."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.backends.speech_in import SpeechInError, load_speech_in
from stages.backends.tiny_speech_in import ensure_tiny_omni, ensure_tiny_ultravox
from stages.conversation import ChatHistory
from stages.messages import CALLER_RATE
from stages.speech_in import EmbeddedPrompt
from stages.tower_batch import BatchedTower

pytestmark = pytest.mark.usefixtures("model_cache")  # tests/stages/conftest.py


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory):
    return load_speech_in(str(ensure_tiny_omni(tmp_path_factory.mktemp("m") / "omni")))


@pytest.fixture(scope="module")
def ultravox(tmp_path_factory: pytest.TempPathFactory):
    return load_speech_in(str(ensure_tiny_ultravox(tmp_path_factory.mktemp("m") / "uv")))


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * CALLER_RATE)) / CALLER_RATE
    wave = np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) * 6000
    return (wave + rng.normal(0, 300, len(t))).astype(np.int16)


def test_omni_reads_windows_of_its_own_attention_blocks(omni) -> None:
    tower = omni.tower("cpu", "float32")
    assert tower.window_samples == 2 * CALLER_RATE  # n_window 100: blocks of 200 mel frames
    whole = tower.rows(speech(2.0))
    assert whole.shape == (50, tower.dim) and whole.dtype == np.float32  # 25 rows a second
    assert np.array_equal(whole, tower.rows(speech(2.0)))  # a window's rows are its own
    assert tower.rows(speech(0.6)).shape == (15, tower.dim)  # a last, shorter window


def test_ultravox_reads_fixed_windows_of_whole_rows(ultravox) -> None:
    tower = ultravox.tower("cpu", "bfloat16")
    assert tower.window_samples == CALLER_RATE * 1920 // 1000  # 12 rows of 160 ms
    rows = tower.rows(speech(1.92))
    assert rows.shape == (12, tower.dim) and rows.dtype == np.uint16  # bfloat16's bits
    assert tower.rows(speech(0.5)).shape == (4, tower.dim)
    with pytest.raises(SpeechInError, match="multiple of 160"):
        load_speech_in(str(ultravox.folder), window_ms=1000)


@pytest.mark.parametrize("checkpoint", ["omni", "ultravox"])
def test_windows_in_one_pass_get_the_rows_they_get_alone(checkpoint, request) -> None:
    """rows_of: several sessions' windows, full and shorter, in as few passes as the family
    allows; each window's rows are what it gets on its own (float32: bit for bit but for the
    order of a batched matmul's sums)."""
    tower = request.getfixturevalue(checkpoint).tower("cpu", "float32")
    full = tower.window_samples
    audios = [speech(full / CALLER_RATE, seed) for seed in range(3)] + [speech(0.6, 3)]
    audios.insert(1, speech(0.5, 4))
    together = tower.rows_of(audios)
    assert len(together) == len(audios)
    for audio, rows in zip(audios, together, strict=True):
        np.testing.assert_allclose(rows, tower.rows(audio), rtol=1e-4, atol=1e-4)
    assert not np.allclose(together[0], together[2])  # each its own, in the order asked


def test_lanes_waiting_together_share_a_pass(omni) -> None:
    """BatchedTower: the windows asked for while a pass runs go in the next one, and each
    lane gets its own window's rows back."""
    tower = omni.tower("cpu", "float32")
    first_pass, go_on = threading.Event(), threading.Event()
    passes: list[int] = []

    class HeldTower:  # the real tower, its first pass held until the others wait
        window_samples, dim, dtype = tower.window_samples, tower.dim, tower.dtype
        rows = tower.rows

        def rows_of(self, audios):
            passes.append(len(audios))
            first_pass.set()
            assert go_on.wait(30)
            return tower.rows_of(audios)

    streams: list[int] = []

    @contextlib.contextmanager
    def on_stream():  # where a GPU's passes run on the tower's own stream
        streams.append(len(passes))
        yield

    batched = BatchedTower(HeldTower(), on_stream=on_stream)
    try:
        audios = [speech(2.0, seed) for seed in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as lanes:
            got = [lanes.submit(batched.rows, audios[0])]
            assert first_pass.wait(30)
            got += [lanes.submit(batched.rows, audio) for audio in audios[1:]]
            for _ in range(3000):  # until the other seven wait (bounded)
                if batched._waiting.qsize() == 7:
                    break
                time.sleep(0.001)
            go_on.set()
            got = [future.result(30) for future in got]
        assert passes == [1, 7]
        assert streams == [0, 1]  # each pass inside the stream's context
        for audio, rows in zip(audios, got, strict=True):
            np.testing.assert_allclose(rows, tower.rows(audio), rtol=1e-4, atol=1e-4)
    finally:
        batched.close()
    with pytest.raises(RuntimeError, match="stopping"):
        batched.rows(speech(2.0))


@pytest.mark.parametrize("family", ["omni", "ultravox"])
def test_the_language_model_is_the_checkpoints_own_as_a_plain_decoder(
    family: str, request: pytest.FixtureRequest, model_cache: Path
) -> None:
    """The language model vLLM serves is the checkpoint's, extracted once: same weights, a
    plain decoder's config (Qwen2.5-Omni's M-RoPE gone: its sections are alike for text and
    audio rows), the checkpoint's tokenizer with the family's audio marker."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    model = request.getfixturevalue(family)
    folder = Path(model.language_model())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert "mrope_section" not in json.dumps(config)
    prefix = "thinker." if family == "omni" else "language_model."
    lm = ("thinker.model.", "thinker.lm_head.") if family == "omni" else ("language_model.",)
    source = load_file(str(model.folder / "model.safetensors"))
    served = {}
    for file in folder.glob("*.safetensors"):
        served.update(load_file(str(file)))
    assert set(served) == {k[len(prefix) :] for k in source if k.startswith(lm)}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(served[name], source[prefix + name])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    (marker,) = tokenizer.encode(model.layout.marker, add_special_tokens=False)
    assert tokenizer.decode([marker]) == model.layout.marker
    assert load_speech_in(str(model.folder)).language_model() == str(folder)  # made once
    assert folder.is_relative_to(model_cache)


def test_a_model_of_no_speech_in_family_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SpeechInError, match="no speech-in family"):
        load_speech_in(str(tmp_path))
    with pytest.raises(SpeechInError, match="no such folder"):
        load_speech_in(str(tmp_path / "missing"))


def _prompt(model) -> EmbeddedPrompt:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.language_model())
    return EmbeddedPrompt(tokenizer, model.layout, 128, torch.float32)


def test_an_open_turns_prompt_is_a_prefix_of_the_replys(omni) -> None:
    """The prefill made as the caller speaks and the reply's prompt share their start token
    for token and row for row: what the prefix cache matches."""
    embedded = _prompt(omni)
    earlier, turn = torch.randn(30, 128), torch.randn(75, 128)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "", "audio": earlier, "turn_id": 1, "transcript": None},
        {"role": "assistant", "content": "Hello there."},
    ]
    spoken = {"role": "user", "content": "", "audio": turn, "turn_id": 2}
    reply = embedded.render([*history, spoken])
    opened = embedded.render([*history, {**spoken, "audio": turn[:50]}], open_turn=True)
    n = len(opened["prompt_token_ids"])
    assert opened["prompt_token_ids"] == reply["prompt_token_ids"][:n]
    assert opened["prompt_is_token_ids"] == reply["prompt_is_token_ids"][:n]
    assert torch.equal(opened["prompt_embeds"], reply["prompt_embeds"][:n])
    assert not any(opened["prompt_is_token_ids"][-50:])  # it ends with the rows so far
    mask = torch.tensor(reply["prompt_is_token_ids"])
    assert (~mask).sum() == 30 + 75  # every row has its position, no marker token is left
    rows = reply["prompt_embeds"][~mask]
    assert torch.equal(rows, torch.cat([earlier, turn]))
    assert not reply["prompt_embeds"][mask].any()  # token positions: vLLM embeds the ids
    assert embedded.count([*history, spoken]) == len(reply["prompt_token_ids"])
    tokens = embedded.tokenizer.decode(
        [t for t, keep in zip(reply["prompt_token_ids"], mask.tolist(), strict=True) if keep]
    )
    assert "<|audio_bos|><|audio_eos|>" in tokens and tokens.endswith("assistant\n")


def test_a_text_that_carries_the_marker_is_refused_not_misplaced(omni) -> None:
    embedded = _prompt(omni)
    messages = [{"role": "user", "content": "say <|AUDIO|> please"}]
    with pytest.raises(ValueError, match="1 audio markers"):
        embedded.render(messages)


def test_fitting_turns_the_oldest_audio_into_words_before_dropping_anything() -> None:
    history = ChatHistory("system", 40)
    for turn in range(3):
        history.add_audio(torch.zeros(100, 8), turn)
        history.transcribed(turn, f"question {turn}")
        history.add("assistant", f"answer {turn}")

    def count(messages) -> int:
        return sum(len(m["audio"]) if "audio" in m else 5 for m in messages)

    assert history.fit(None, count, 130) == 0  # the two oldest turns are their words now
    assert [m.get("audio") is not None for m in history.messages if m["role"] == "user"] == [
        False,
        False,
        True,
    ]
    assert history.messages[0]["content"] == "question 0"
    assert history.fit(None, count, 20) > 0  # then messages go, oldest first
    assert all("audio" not in m for m in history.messages)
