"""Private temporary folders that belong to one process.

Named `<prefix><pid>-<random>` in the system's temporary folder, each is removed by its owner
when done and, if the owner was killed first, by the next process to make one of the same
prefix. vLLM's sockets (stages.backends.llm_vllm), the MPS daemon's pipes (stages.mps) and the
gateway processes' sockets and metrics files (gateway) are kept in such folders.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def owned_folder(prefix: str) -> Path:
    """A new folder `<tmp>/<prefix><pid>-<random>` of this process; removes those of dead
    owners first."""
    reap_orphans(prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


@contextlib.contextmanager
def owned_temporary(prefix: str) -> Iterator[Path]:
    """An `owned_folder`, removed with what it holds when the block ends."""
    folder = owned_folder(prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def reap_orphans(prefix: str) -> list[Path]:
    """Remove the folders of `prefix` whose owner process is gone; returns them."""
    reaped = []
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = folder.name.removeprefix(prefix).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
            reaped.append(folder)
    return reaped
