"""stages.supervisor: a start that fails part-way leaves nothing behind and says why, not an
error of its own cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_config
from stages import supervisor as supervisor_module
from stages.supervisor import Supervisor

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
STARTED: list = []


class SecondStartFails(supervisor_module._ctx.Process):
    """The first stage's process starts; the next one cannot (as when processes run out)."""

    def start(self) -> None:
        if STARTED:
            raise OSError(11, "Resource temporarily unavailable")
        STARTED.append(self)
        super().start()


def test_a_stage_process_that_cannot_be_started_fails_the_start_cleanly(monkeypatch) -> None:
    monkeypatch.setattr(supervisor_module._ctx, "Process", SecondStartFails)
    supervisor = Supervisor(load_config(TINY))
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        supervisor.start()
    (first,) = STARTED
    assert first.exitcode is not None  # the stage that did start was stopped
    prefix = supervisor.names.prefix.lstrip("/")
    assert not [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
