"""Owning asyncio tasks: every task named and referenced until it ends, and stopped one way.

`cancel_and_wait` replaces `task.cancel(); with suppress(CancelledError): await task`, which
also swallows a cancellation aimed at the caller, and waits for ever on a task that ignores
its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


async def cancel_and_wait(task: asyncio.Task[Any], timeout: float = STOP_TIMEOUT_S) -> bool:
    """Cancel `task` and wait up to `timeout` s for it to end; True once it has.

    The task's own cancellation ends here; the caller's is re-raised, never swallowed. An
    exception the task ended with is logged (nobody else will retrieve it)."""
    if task is asyncio.current_task():
        raise RuntimeError(f"task {task.get_name()!r} cannot wait for itself to stop")
    task.cancel()
    await asyncio.wait({task}, timeout=timeout)  # raises only the caller's CancelledError
    return _ended(task, timeout)


def _ended(task: asyncio.Task[Any], timeout: float) -> bool:
    if not task.done():
        logger.warning("task %s did not stop within %.1f s", task.get_name(), timeout)
        return False
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.error("task %s failed as it stopped", task.get_name(), exc_info=exc)
    return True


class Tasks:
    """The tasks one component owns: `spawn` names each and keeps it until it ends; `close`
    cancels them all and waits for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel every task but the caller's own and wait for them, `timeout` s at most."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            _ended(task, timeout)
