"""Suite-wide fixtures: no test may leave a shared-memory segment behind; speech recordings; the
stages and gateway of an end-to-end module, built from that module's own `config` fixture.

The recordings come from Debian's ``espeak-ng`` and ``sox`` command-line tools (independent of the
espeak backend under test), with espeak's Klatt variant: PocketSphinx recognizes it far better than
the default voice (17 of 20 words against 8 in a trial here).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import wave
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from shm._ring import pid_alive

from shm import list_segments
from shm.segments import owner_of
from stages.supervisor import Supervisor
from tests.serving import serving_gateway

# vLLM's worker runs inside its engine core process, as it does on one GPU, instead of in a
# process of its own (vLLM's CPU default): the suite starts about twenty engines, and the extra
# process costs each ~13 s to start and ~2 s to stop on two cores. The stages, the `start`
# commands and the Ray actors the tests run inherit it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = set(list_segments())
    yield
    # only segments this process (or a dead process) owns: another checkout's run on the same
    # machine may create its own meanwhile
    leaked = [
        name
        for name in set(list_segments()) - before
        if (owner := _owner_pid(name)) == os.getpid() or not pid_alive(owner)
    ]
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"


def _owner_pid(name: str) -> int:
    try:
        return owner_of(name)[1]
    except FileNotFoundError:  # unlinked meanwhile
        return -1  # pid_alive() takes an unknown owner for a live one


SPEECH_VOICE = ["-v", "en-us+klatt", "-s", "140"]


@dataclass(frozen=True)
class SpeechRecording:
    """A spoken sentence as 16 kHz mono PCM16, with the text it says."""

    text: str
    path: Path
    pcm16: np.ndarray

    @property
    def seconds(self) -> float:
        return len(self.pcm16) / 16000


#: Made recordings are kept here, by text and tool settings, for later runs and for machines
#: without the tools (the GPU machines: loadtest/gpu/device-tests.sh carries this folder).
SPEECH_CACHE = Path(
    os.environ.get("OMNI_TEST_SPEECH_CACHE", Path(__file__).parents[1] / ".cache" / "test-speech")
)
SOX_ARGS = ["-r", "16000", "-c", "1", "-b", "16"]
SOX_EFFECTS = ["pad", "0.5", "0.5"]


@pytest.fixture(scope="session")
def make_speech() -> Callable[[str], SpeechRecording]:
    """Speak a sentence with the espeak-ng CLI into a 16 kHz WAV (0.5 s of silence around it)."""
    made: dict[str, SpeechRecording] = {}

    def make(text: str) -> SpeechRecording:
        if text not in made:
            recipe = json.dumps([SPEECH_VOICE, SOX_ARGS, SOX_EFFECTS, text]).encode()
            wav = SPEECH_CACHE / f"{hashlib.sha1(recipe).hexdigest()[:16]}.wav"
            if not wav.exists():
                _speak(text, wav)
            with wave.open(str(wav)) as reader:
                assert reader.getframerate() == 16000 and reader.getsampwidth() == 2
                pcm16 = np.frombuffer(reader.readframes(reader.getnframes()), dtype=np.int16)
            made[text] = SpeechRecording(text, wav, pcm16)
        return made[text]

    return make


def _speak(text: str, wav: Path) -> None:
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: apt-get install -y espeak-ng sox")
    wav.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wav.parent) as folder:  # same filesystem
        raw, made = Path(folder) / "raw.wav", Path(folder) / "speech.wav"
        subprocess.run(["espeak-ng", *SPEECH_VOICE, "-w", str(raw), text], check=True)
        subprocess.run(["sox", str(raw), *SOX_ARGS, str(made), *SOX_EFFECTS], check=True)
        os.replace(made, wav)  # whole or not at all, for a run beside this one


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A test that failed beside a running `supervisor` gets every stage's thread stacks in its
    captured output (stage processes dump them on SIGUSR1): what a stuck stage was doing."""
    report = yield
    supervisor = getattr(item, "funcargs", {}).get("supervisor")
    if report.when == "call" and report.failed and isinstance(supervisor, Supervisor):
        for name, stage in supervisor.stages.items():
            if stage.process is not None and stage.process.is_alive():
                print(f"--- {name} (pid {stage.process.pid}) threads ---", file=sys.stderr)
                os.kill(stage.process.pid, signal.SIGUSR1)
        time.sleep(0.5)  # a failure path only: the dumps are written by the stage processes
    return report


@pytest.fixture(scope="module")
def restarted() -> threading.Event:
    """Set when the module's supervisor restarts a stage."""
    return threading.Event()


# Modules that run the same stages (their configs differ in the gateway's section only), run
# one after another so that they share them (SharedStages). A module whose tests restart a
# stage goes last in its group: restarted stages are not handed on.
SHARING_STAGES = (
    ("gateway/test_offline_call.py", "gateway/test_tools.py", "web/test_demo_page_offline.py"),
    (  # tests.serving.tiny_call_config
        "gateway/test_call_e2e.py",
        "gateway/test_realtime_sdk.py",
        "gateway/test_livekit_agents.py",
        "gateway/test_twilio.py",
        "web/test_demo_page.py",
        "web/test_agents_sdk.py",
        "gateway/test_hardening.py",
    ),
)


def stage_key(config: Any) -> str:
    """What a supervisor's stages are made of: the whole config but the gateway's own section
    (auth, tools, telephony, limits), which only the module's gateway reads."""
    return json.dumps(config.model_dump(mode="json", exclude={"gateway"}), sort_keys=True)


class SharedStages:
    """The stages of the last end-to-end module, kept running for the next module if it needs
    the same ones: a vLLM start takes 30-60 s of a 2-core machine. Stopped (and checked to
    leave no segment and no process) as soon as a module needs other stages or none, and at
    the end of the session. Stages that were ever restarted are not handed on."""

    def __init__(self) -> None:
        self.supervisor: Supervisor | None = None
        self.key = ""
        self.restarted = threading.Event()  # the current module's

    def stages_for(self, config: Any, restarted: threading.Event) -> Supervisor:
        key, sup = stage_key(config), self.supervisor
        self.restarted = restarted
        if sup is not None and key == self.key and self._untouched(sup):
            return sup
        self.stop()
        sup = Supervisor(config, on_restart=lambda stage, n: self.restarted.set())
        try:
            sup.start()
        except BaseException:
            sup.stop()
            raise
        self.supervisor, self.key = sup, key
        return sup

    @staticmethod
    def _untouched(sup: Supervisor) -> bool:
        return all(
            s.restarts == 0 and s.process is not None and s.process.is_alive()
            for s in sup.stages.values()
        )

    def stop(self) -> None:
        sup, self.supervisor = self.supervisor, None
        if sup is None:
            return
        segments = [sup.names.control, *(sup.names.ring(*link) for link in sup.rings.rings)]
        sup.stop()
        assert not set(segments) & set(list_segments()), "supervisor left segments behind"
        assert all(not s.process.is_alive() for s in sup.stages.values())


@pytest.fixture(scope="session")
def shared_stages() -> Iterator[SharedStages]:
    shared = SharedStages()
    try:
        yield shared
    finally:
        shared.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each group of SHARING_STAGES runs together, where its first module would have run."""
    root = Path(__file__).parent
    module_of = {item: item.path.relative_to(root).as_posix() for item in items}
    rank = {m: (group[0], i) for group in SHARING_STAGES for i, m in enumerate(group)}
    first_seen: dict[str, int] = {}
    for n, item in enumerate(items):
        first_seen.setdefault(rank.get(module_of[item], (module_of[item], 0))[0], n)

    def order(item_index: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        n, item = item_index
        anchor, place = rank.get(module_of[item], (module_of[item], 0))
        return first_seen[anchor], place, n

    items[:] = [item for _, item in sorted(enumerate(items), key=order)]


@pytest.fixture(scope="module", autouse=True)
def _stages_only_where_needed(request: pytest.FixtureRequest, shared_stages: SharedStages) -> None:
    """A module that runs no stages of its own runs without any left running."""
    if "supervisor" not in request.fixturenames:
        shared_stages.stop()


@pytest.fixture(scope="module")
def supervisor(
    config, restarted: threading.Event, shared_stages: SharedStages
) -> Iterator[Supervisor]:
    """The stages of the requesting module's `config`, running for the whole module (and
    handed on to the next module that needs the same: SharedStages); once they are stopped,
    no segment of theirs and no stage process is left."""
    yield shared_stages.stages_for(config, restarted)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(config, supervisor) -> AsyncIterator[tuple[str, web.Application]]:
    """(base URL, app) of the gateway in front of `supervisor`, on 127.0.0.1."""
    async with serving_gateway(config, supervisor) as served:
        yield served
