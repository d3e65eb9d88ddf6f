"""Fixtures of the stage tests: tiny random-weight models built once per session, and the
gateway's end of the rings of a module's `supervisor` (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.backends.tiny_speech_models import (
    TinySpeechT5,
    ensure_tiny_speecht5,
    ensure_tiny_whisper,
)
from stages.link import EventQueues, PipelineLink
from stages.supervisor import Supervisor

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


def tiny_with_long_replies():
    """configs/tiny.yaml with replies long enough that one is always in flight to cancel, and
    synthesis unpaced (no real-time listener at the rings' end)."""
    from gateway.config import load_config

    return load_config(
        TINY,
        {
            "reasoning.sampling": {"max_tokens": 160, "ignore_eos": True},
            "max_sessions": 16,
            "vocoder.max_lead_ms": 600_000,
        },
    )


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random-weight Whisper, built once per session."""
    return ensure_tiny_whisper(tmp_path_factory.mktemp("models") / "tiny-whisper")


@pytest.fixture(scope="session")
def tiny_speecht5(tmp_path_factory: pytest.TempPathFactory) -> TinySpeechT5:
    """Folders of a tiny random-weight SpeechT5 and HiFi-GAN, built once per session."""
    return ensure_tiny_speecht5(tmp_path_factory.mktemp("models") / "tiny-speecht5")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread for the module, then restore the count.

    Tiny models spend their time in thread hand-offs: on 2 busy cores one thread is ~8x faster.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def events() -> EventQueues:
    return EventQueues()


@pytest.fixture(scope="module")
def link(supervisor: Supervisor, events: EventQueues) -> Iterator[PipelineLink]:
    link = PipelineLink(supervisor.names, events)
    yield link
    link.close()


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Models built or extracted in the module (OMNI_GATEWAY_CACHE) go to a cache of its own,
    gone with the test run."""
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("cache")
        patch.setenv("OMNI_GATEWAY_CACHE", str(cache))
        yield cache
