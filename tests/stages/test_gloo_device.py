"""One gloo device for every gloo process group of a process (stages/backends/gloo_device.py).

Each case runs in a fresh interpreter: torch.distributed's state is per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from stages.backends.gloo_device import LOOP_TIMER_SLACK_NS, SHARED_GLOO_ENV

GROUPS = 6

# A world of one, as vLLM's worker on one CPU makes it, with GROUPS groups beside the default.
# Every gloo device runs a loop on an epoll instance of its own: count them in /proc.
_PROGRAM = textwrap.dedent(
    f"""
    import json, os, socket
    import torch, torch.distributed as dist
    from stages.backends import gloo_device

    def epolls():
        fds = os.listdir("/proc/self/fd")
        return sum(os.readlink(f"/proc/self/fd/{{fd}}") == "anon_inode:[eventpoll]"
                   for fd in fds if os.path.exists(f"/proc/self/fd/{{fd}}"))

    gloo_device.enable()
    before = epolls()
    with socket.socket() as s:  # a free port on loopback for the store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1
    )
    groups = [dist.new_group([0], backend="gloo") for _ in range({GROUPS})]
    sums = []
    for group in groups:
        t = torch.ones(3)
        dist.all_reduce(t, group=group)
        sums.append(t.sum().item())
    shared = getattr(dist.distributed_c10d.ProcessGroupGloo, "shares_one_device", False)
    slack = {{}}  # timer slack (ns) of each thread, by its name
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/{{tid}}/comm").read().strip()
        slack.setdefault(name, set()).add(int(open(f"/proc/{{tid}}/timerslack_ns").read()))
    slack = {{name: sorted(values) for name, values in slack.items()}}
    mine = int(open(f"/proc/{{os.getpid()}}/timerslack_ns").read())
    print(json.dumps({{"epolls": epolls() - before, "sums": sums, "shared": shared,
                      "slack": slack, "main_slack": mine}}))
    dist.destroy_process_group()
    """
)


def _run(shared: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != SHARED_GLOO_ENV}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the device on loopback: the tests talk to 127.0.0.0/8
    if shared is not None:
        env[SHARED_GLOO_ENV] = shared
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_groups_share_one_device_only_where_the_engine_asks() -> None:
    shared = _run("1")
    per_group = _run(None)
    turned_off = _run("0")
    # every group still reduces (a world of one: the sum of three ones)
    for result in (shared, per_group, turned_off):
        assert result["sums"] == [3.0] * GROUPS
    assert shared["shared"] is True
    assert per_group["shared"] is False and turned_off["shared"] is False
    # the default group and GROUPS more: one polling loop instead of one each (the store
    # has an epoll instance of its own in both)
    assert per_group["epolls"] == turned_off["epolls"] == shared["epolls"] + GROUPS
    # that loop may sleep past its 10 ms tick; the thread that made it is as it was
    assert shared["slack"]["gloo_tcp_loop"] == [LOOP_TIMER_SLACK_NS]
    assert shared["main_slack"] == per_group["main_slack"] < LOOP_TIMER_SLACK_NS
    assert LOOP_TIMER_SLACK_NS not in per_group["slack"]["gloo_tcp_loop"]


def test_vllm_finds_the_plugin() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("omni_gateway_gloo") == "stages.backends.gloo_device:enable"
