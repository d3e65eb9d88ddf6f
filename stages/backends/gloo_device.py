"""One gloo device for every gloo process group of a vLLM engine process: an idle engine idles.

torch gives each gloo process group a TCP device of its own, and each device a loop thread that
wakes every 10 ms (``epoll_wait`` with a fixed timeout in gloo's ``tcp/loop.cc``) whether or
not anything is on the wire. vLLM's worker makes about a dozen gloo groups even for a world of
one (a CPU group beside each parallel dimension's group), so an engine with no request spent
about 1% of a core on those wake-ups alone. A gloo device serves any number of contexts; with
one device a process has one loop. That loop's thread is also given a timer slack of
``LOOP_TIMER_SLACK_NS``: the kernel may then let its 10 ms timeout run up to that much longer,
so an idle loop wakes about 10 times a second instead of 100. Readiness of a socket still wakes
it at once (slack applies to timeouts only), so collectives are as fast as before; what waits
for a loop tick, such as closing a pair at teardown, may wait up to 0.1 s.

``enable`` is a vLLM general plugin (entry point ``vllm.general_plugins``: ``omni_gateway_gloo``),
which vLLM runs in its engine-core and worker processes before they create a process group. It
acts only where ``SHARED_GLOO_ENV`` is "1": ``VllmEngine.start`` sets it (unless it is set
already, so ``OMNI_GATEWAY_SHARED_GLOO=0`` turns it off) for the engines the stages spawn, and
other vLLM programs in the same environment are left as they are.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Set to "1" in a process whose vLLM engines (and their child processes) share one gloo device.
SHARED_GLOO_ENV = "OMNI_GATEWAY_SHARED_GLOO"
#: Timer slack of the device's loop thread (ns): how much later than its 10 ms tick it may wake.
LOOP_TIMER_SLACK_NS = 90_000_000

_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30  # linux/prctl.h

_lock = threading.Lock()
_device: list[Any] = []  # the process's one device, made with the first group


def enable() -> None:
    """Make every gloo process group created from now on in this process use one device.

    Idempotent, and a no-op unless ``SHARED_GLOO_ENV`` is "1".
    """
    if os.environ.get(SHARED_GLOO_ENV) != "1":
        return
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo
    if getattr(gloo, "shares_one_device", False):
        return
    distributed_c10d.ProcessGroupGloo = _shared_device_class(gloo)


def _shared_device_class(gloo: type) -> type:
    class SharedDeviceGloo(gloo):  # type: ignore[misc, valid-type]
        """``ProcessGroupGloo`` whose groups all use this process's one device."""

        shares_one_device = True

        def __init__(
            self,
            store: Any,
            rank: int,
            size: int,
            timeout: Any = datetime.timedelta(minutes=30),
        ) -> None:
            # torch's other constructor takes the options whole: pass those through untouched
            if isinstance(timeout, gloo._Options):
                super().__init__(store, rank, size, timeout)
                return
            options = gloo._Options()
            options._timeout = timeout
            options._devices = [_process_device(gloo)]
            super().__init__(store, rank, size, options)

    return SharedDeviceGloo


def _process_device(gloo: type) -> Any:
    with _lock:
        if not _device:
            # the device torch would make for the group (its host name or GLOO_SOCKET_IFNAME);
            # its loop thread starts in the constructor and takes this thread's timer slack
            with _timer_slack(LOOP_TIMER_SLACK_NS):
                _device.append(gloo.create_default_device())
        return _device[0]


@contextmanager
def _timer_slack(ns: int) -> Iterator[None]:
    """This thread's timer slack set to `ns` for the block; threads started inside keep it."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if before < 0 or libc.prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) != 0:
        yield  # not Linux, or refused: the loop polls at its own rate
        return
    try:
        yield
    finally:
        libc.prctl(_PR_SET_TIMERSLACK, before, 0, 0, 0)
