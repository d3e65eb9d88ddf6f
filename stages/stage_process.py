"""The entry point of a stage process: attach the rings, load, report ready, run until SIGTERM.

The supervisor spawns `stage_main` with a `StageSpec`; the stage's class is imported here, in
the process, so that each process loads only the models of its own stage.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from stages import placement, process_groups
from stages.config import PipelineConfig
from stages.rings import RingNames, attach_ends, role_of
from stages.stage import Stage

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5  # how often a stage checks that its supervisor is alive


@dataclass(frozen=True)
class StageSpec:
    """What a stage process is started with (picklable for spawn)."""

    stage: str  # the instance: 'vocoder', or 'vocoder.1' for a replica
    names: RingNames
    config: dict[str, Any]
    log_level: int = logging.INFO
    # set first thing in the process (its GPUs, NVLink multicast off); see stages.placement
    env: dict[str, str] = field(default_factory=dict)


def stage_class(instance: str) -> type[Stage]:
    """The class of a stage instance ('vocoder.1' is a VocoderStage)."""
    name = role_of(instance)
    if name == "encoder":
        from stages.encoder import EncoderStage

        return EncoderStage
    if name == "reasoning":
        from stages.reasoning import ReasoningStage

        return ReasoningStage
    if name == "vocoder":
        from stages.vocoder import VocoderStage

        return VocoderStage
    raise ValueError(f"unknown stage {name!r}")


def _stop_without_supervisor(supervisor_pid: int, stop: threading.Event) -> None:
    """A supervisor killed outright (SIGKILL, OOM) cannot stop its stages: they notice it is
    gone (they are re-parented) and stop themselves as SIGTERM would stop them, models and GPU
    memory included; its segments are reaped by the next supervisor to start."""
    while not stop.wait(PARENT_CHECK_S):
        if os.getppid() != supervisor_pid:
            logger.error("the supervisor (pid %d) is gone; stopping", supervisor_pid)
            if _running.is_set():
                # the stage's own SIGTERM handler, which also wakes a model loop on asyncio
                os.kill(os.getpid(), signal.SIGTERM)
                if stop.wait(ORPHAN_STOP_S) and _closed.wait(ORPHAN_STOP_S):
                    return
                logger.error("not stopped in %.0f s: killing this stage's group", ORPHAN_STOP_S)
            # still loading (nothing to close cleanly), or stuck closing: end what it started
            # (vLLM's engine core), then itself
            process_groups.end_group(os.getpgrp())
            os._exit(1)


def _tell(conn: Connection, message: tuple[str, str]) -> None:
    with contextlib.suppress(OSError):  # the supervisor may be gone
        conn.send(message)


#: Set once the model loop runs (before that, a stage without a supervisor exits at once).
_running = threading.Event()
#: Set once the stage has closed its models, as it exits.
_closed = threading.Event()
ORPHAN_STOP_S = 20.0  # a stage whose supervisor died has this long to close its models


def stage_main(spec: StageSpec, conn: Connection) -> None:
    """Entry point of a stage process: load, report ready, run until SIGTERM."""
    # a group of its own, which vLLM's processes join: ended whole if this one dies
    process_groups.own_group()
    # before anything can initialise CUDA: this process and its children see only its GPUs
    os.environ.update(spec.env)
    if spec.log_level > logging.DEBUG:
        # model libraries' own start-up chatter (vLLM's config dumps and its notes on what
        # this CPU lacks, torch's C++ warnings, deprecations) only with --log-level DEBUG;
        # their errors still show
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # its children too
        warnings.filterwarnings("ignore", category=FutureWarning)
    # stdout belongs to the command that started us (say-file --json prints there); model
    # libraries log to stdout, so point it, and their own child processes, at stderr
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s {spec.stage}[%(process)d] %(levelname)s %(message)s",
    )
    if spec.log_level > logging.DEBUG:
        logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # a line a decode
    stop = threading.Event()
    # Ctrl-C reaches the whole process group; the supervisor decides, and stops us by SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck stage is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(
        target=_stop_without_supervisor,
        args=(os.getppid(), stop),
        name="supervisor-watch",
        daemon=True,
    ).start()
    stage: Stage | None = None
    try:
        config = PipelineConfig.model_validate(spec.config)
        stage_config = getattr(config, role_of(spec.stage))
        ends = attach_ends(spec.names, spec.stage)
        try:
            stage = stage_class(spec.stage)(config, ends, stop)
        except BaseException:
            ends.close()
            raise
        placement.apply_memory_share(
            getattr(stage_config, "device", "cpu"),
            getattr(stage_config, "gpu_memory_fraction", None),
        )
        info = stage.load()
        stage.start_readers()
        conn.send(("ready", {"pid": os.getpid(), **info, **placement.visible_report()}))
        stage.cannot_serve = lambda why: _tell(conn, ("cannot_serve", why))
        _running.set()
        stage.run()
    except BaseException as exc:
        logger.error("%s failed: %s", spec.stage, "".join(traceback.format_exception(exc)))
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        stop.set()
        if stage is not None:
            stage.close()
        _closed.set()
