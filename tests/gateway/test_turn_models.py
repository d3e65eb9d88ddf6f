"""The turn models on real weights (Silero VAD, Smart Turn v3.2, as set-up fetched them), and
what a gateway process loads of them (gateway.turns.models)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gateway.turns.classifiers import SileroClassifier
from gateway.turns.detector import TurnDetector, VadStart, VadStop
from gateway.turns.end_of_turn import Eagerness
from gateway.turns.silero import SileroModel, SileroStream
from gateway.turns.smart_turn import WINDOW_SAMPLES, SmartTurnModel
from loadtest.offline_quality import speak
from loadtest.sounds import cough
from stages.audio import resample
from stages.backends import bundled
from stages.messages import FRAME_SAMPLES


@pytest.fixture(scope="module")
def question() -> np.ndarray:
    """A finished question in the Piper voice, 16 kHz, silence around it."""
    return resample(
        speak(["Can you tell me the weather in Paris today?"], "piper", varied=False)[0],
        48000,
        16000,
    )


@pytest.fixture(scope="module")
def silero() -> SileroModel:
    return SileroModel(bundled.resolve("bundled:silero-vad"))


def frames(pcm: np.ndarray) -> list[np.ndarray]:
    return [
        pcm[i : i + FRAME_SAMPLES] for i in range(0, len(pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES)
    ]


def test_silero_calls_speech_speech_and_silence_silence(silero, question) -> None:
    voice = SileroStream(silero)
    p = np.array([voice.probability(f) for f in frames(question)])
    lead = int(0.3 * 50)  # speak() puts 0.3 s of silence first
    assert p[: lead - 2].max() < 0.2
    assert np.mean(p[lead + 5 : lead + 60] > 0.5) > 0.6
    voice.reset()
    assert max(voice.probability(f) for f in frames(cough(seed=1))) < 0.5


def test_a_silero_turn_detector_starts_and_ends_the_turn(silero, question) -> None:
    vad = TurnDetector(classifier=SileroClassifier(silero, 0.5))
    events = [
        e
        for f in frames(np.concatenate([question, np.zeros(16000, np.int16)]))
        for e in vad.feed(f)
    ]
    kinds = [type(e) for e in events]
    assert kinds == [VadStart, VadStop], kinds
    stopped = events[-1]
    assert stopped.audio_end_ms - stopped.speech_end_ms == 500


def test_the_end_of_turn_model_hears_a_finished_question_and_one_cut_short(question) -> None:
    model = SmartTurnModel(bundled.resolve("bundled:smart-turn-v3.2"))
    voiced = np.nonzero(np.abs(question) > 300)[0]
    whole = question[: voiced[-1] + 3200]  # 200 ms of silence after the last word
    assert model.probability(whole) >= Eagerness("medium").complete
    assert model.probability(question[: int(1.5 * 16000)]) < 0.5  # "...the weather in"
    features = model.features(whole)
    assert features.shape == (80, WINDOW_SAMPLES // 160)
    # short audio is padded at the front: the last frames are the speech, the first are not
    assert features[:, -50:].std() > features[:, :50].std()


def test_a_gateway_process_with_its_turn_models_runs_blas_on_one_thread() -> None:
    """OpenBLAS's threads spin through an end-of-turn prediction on every core unless the
    process keeps BLAS to one thread (gateway.turns.models); a fresh process, since the limit
    holds for the whole process."""
    script = (
        "import json, numpy, threadpoolctl\n"
        "from gateway.config import TurnsConfig\n"
        "from gateway.turns.models import TurnModels\n"
        "blas = lambda: [i['num_threads'] for i in threadpoolctl.threadpool_info()"
        " if i['user_api'] == 'blas']\n"
        "before = blas()\n"
        "models = TurnModels(TurnsConfig())\n"
        "print(json.dumps([before, blas(), models.end_of_turn is not None]))\n"
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}  # as on a 2-core machine
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded and before and max(before) == 2
    assert after and set(after) == {1}
