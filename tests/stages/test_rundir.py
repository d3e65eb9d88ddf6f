"""The supervisor's private folders (stages.rundir): named after their owner, and removed by
the next owner when theirs is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from stages.rundir import owned_folder, owned_temporary, reap_orphans

PREFIX = "omni-test-run-"


def test_a_folder_whose_owner_died_is_removed_at_the_next_start() -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    orphan = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{gone.stdout.strip()}-"))
    (orphan / "socket-left-behind").touch()
    mine = owned_folder(PREFIX)
    try:
        assert mine.name.startswith(f"{PREFIX}{os.getpid()}-") and mine.is_dir()
        assert not orphan.exists()
        assert reap_orphans(PREFIX) == []  # its owner, this process, is alive
        assert mine.exists()
    finally:
        mine.rmdir()


def test_a_temporary_owned_folder_goes_with_what_it_holds() -> None:
    with owned_temporary(PREFIX) as folder:
        (folder / "gateway.1.sock").touch()
    assert not folder.exists()
