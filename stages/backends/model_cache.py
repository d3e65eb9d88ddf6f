"""Where models built or fetched on this machine live, and how a folder is made once.

Every folder is built in a temporary sibling, marked complete and renamed into place, so a
crash never leaves a folder that looks finished (a half-done one is rebuilt, never loaded) and
concurrent builders do not clash.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

#: Written last; a folder without it is a half-finished build and is rebuilt.
COMPLETE_MARKER = ".omni-gateway-build-complete"


def cache_folder(name: str) -> Path:
    """``$OMNI_GATEWAY_CACHE/<name>`` if set, else ``~/.cache/omni-gateway/<name>``."""
    root = os.environ.get("OMNI_GATEWAY_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "omni-gateway"
    return base / name


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished build (its completion marker was written)."""
    return (folder / COMPLETE_MARKER).is_file()


def build_once(folder: Path, build: Callable[[Path], None], what: str) -> Path:
    """Run ``build(staging)`` unless ``folder`` holds a finished build; return the folder.
    ``what`` names the model in log lines ("tiny chat model (random weights)")."""
    folder = Path(folder).expanduser().absolute()
    if is_complete(folder):
        return folder
    if folder.exists():
        logger.warning("rebuilding the unfinished %s folder %s", what, folder)
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model folder is not a secret
    try:
        build(staging)
        (staging / COMPLETE_MARKER).write_text("ok\n")
        try:
            staging.rename(folder)
        except OSError:
            # Another process finished first; its build is as good as ours.
            if not is_complete(folder):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built the %s in %s", what, folder)
    return folder
