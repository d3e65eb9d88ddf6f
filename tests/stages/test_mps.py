"""The MPS daemon's lifecycle, against a stand-in for nvidia-cuda-mps-control (this machine has
no GPU): started in the foreground with private pipe and log folders, quit through its control
pipe, and never outliving the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from stages.config import PipelineConfig
from stages.mps import MpsDaemon, MpsError, client_env

# -f: the daemon (makes its control pipe, records its pid, waits for quit); no argument: the
# client, which reads a command from stdin
FAKE_CONTROL = """\
#!/bin/sh
pipe="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-f" ]; then
    [ -d "$CUDA_MPS_LOG_DIRECTORY" ] || exit 3
    echo $$ > "$PIDFILE"
    touch "$pipe/control"
    while [ ! -e "$pipe/quit" ]; do sleep 0.02; done
    exit 0
fi
read cmd
[ "$cmd" = quit ] && touch "$pipe/quit"
"""


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "fake-mps-control"
    path.write_text(FAKE_CONTROL)
    path.chmod(0o755)
    monkeypatch.setenv("PIDFILE", str(tmp_path / "daemon.pid"))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (reaped by nobody yet) counts as gone
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_start_gives_stages_private_folders_and_stop_quits_and_cleans(control: Path) -> None:
    daemon = MpsDaemon.start(str(control))
    try:
        pipe = Path(daemon.env["CUDA_MPS_PIPE_DIRECTORY"])
        assert (pipe / "control").exists()
        assert Path(daemon.env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        assert daemon.process.poll() is None
    finally:
        daemon.stop()
    assert daemon.process.returncode == 0  # quit by its control pipe, not killed
    assert not daemon.folder.exists()
    daemon.stop()  # twice is fine


def test_missing_control_program_is_a_clear_error() -> None:
    with pytest.raises(MpsError, match="no-such-mps-control is not on PATH"):
        MpsDaemon.start("no-such-mps-control")


def test_daemon_that_exits_at_once_is_reported_with_its_status(tmp_path: Path) -> None:
    path = tmp_path / "broken-control"
    path.write_text("#!/bin/sh\necho 'cannot open the GPU' >&2\nexit 7\n")
    path.chmod(0o755)
    with pytest.raises(MpsError, match="status 7: cannot open the GPU"):
        MpsDaemon.start(str(path))
    assert not list(Path(tempfile.gettempdir()).glob(f"omni-mps-{os.getpid()}-*"))


def test_daemon_dies_with_a_killed_supervisor(control: Path, tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys, time
                from stages.mps import MpsDaemon
                MpsDaemon.start({str(control)!r})
                print("started", flush=True)
                time.sleep(60)
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "started"
        pid = int((tmp_path / "daemon.pid").read_text())
        assert _alive(pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        # the parent-death signal: poll, bounded, for the kernel to have delivered it
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid)
        # and its folder goes at the next start
        orphans = list(Path(tempfile.gettempdir()).glob(f"omni-mps-{owner.pid}-*"))
        assert orphans
        MpsDaemon.start(str(control)).stop()
        assert not any(folder.exists() for folder in orphans)
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def test_thread_shares_cap_a_stage_only_under_mps() -> None:
    config = PipelineConfig(gpu_sharing="mps", experiments={"mps_thread_percent": {"vocoder": 40}})
    assert client_env(config.experiments.mps_thread_percent.get("vocoder")) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"
    }
    assert client_env(config.experiments.mps_thread_percent.get("encoder")) == {}
    with pytest.raises(
        ValidationError, match=r"experiments\.mps_thread_percent is set but gpu_sharing is 'time"
    ):
        PipelineConfig(experiments={"mps_thread_percent": {"vocoder": 40}})
    with pytest.raises(ValidationError, match=r"mps_thread_percent\.vocoder"):
        PipelineConfig(gpu_sharing="mps", experiments={"mps_thread_percent": {"vocoder": 0}})
    with pytest.raises(ValidationError, match=r"mps_thread_percent\.decoder"):
        PipelineConfig(gpu_sharing="mps", experiments={"mps_thread_percent": {"decoder": 40}})


def test_low_priority_stages_are_below_normal_clients_only_under_mps() -> None:
    config = PipelineConfig(gpu_sharing="mps", mps_low_priority=["vocoder"])
    assert client_env(None, "vocoder" in config.mps_low_priority) == {
        "CUDA_MPS_CLIENT_PRIORITY": "1"
    }
    assert client_env(30, low_priority=True) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_CLIENT_PRIORITY": "1",
    }
    assert "CUDA_MPS_CLIENT_PRIORITY" not in client_env(30)
    with pytest.raises(ValidationError, match="mps_low_priority is set but gpu_sharing"):
        PipelineConfig(mps_low_priority=["vocoder"])
    with pytest.raises(ValidationError, match=r"mps_low_priority\.0"):
        PipelineConfig(gpu_sharing="mps", mps_low_priority=["talker"])
