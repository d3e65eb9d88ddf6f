"""Where models built or fetched on this machine live, and how a folder is made once.

Every folder is built in a temporary sibling, marked complete and renamed into place, so a
crash never leaves a folder that looks finished (a half-done one is rebuilt, never loaded) and
concurrent builders do not clash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

#: Written last; a folder without it is a half-finished build and is rebuilt.
COMPLETE_MARKER = ".omni-gateway-build-complete"
#: speech-in models' language models, each in a folder of its own
LM_CACHE = "speech-in-language-models"


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


#: a checkpoint's files the language model served alone needs beside its weights
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def copy_tokenizer(checkpoint: Path, language_model: Path) -> None:
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, language_model / name)


def language_model_folder(source: str, folder: Path) -> Path:
    """Where a speech-in model's language model, served alone, lives: extracted once from
    the checkpoint in `folder` (stages.backends.speech_in), or written there by a builder of
    random weights."""
    key = hashlib.sha1(f"{source}|{folder}".encode()).hexdigest()[:12]
    return cache_folder(LM_CACHE) / f"{folder.name}-{key}"
