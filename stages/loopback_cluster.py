"""A real multi-node Ray cluster on one machine, for tests and benchmarks: a head and raylets
started by `ray start`, each node a process tree of its own on its own loopback address
(127.0.0.x), as Ray's own tests simulate nodes. Health checks are shortened so that a killed
node is declared dead within a second rather than Ray's default 15-20 s.

Each node has its own temporary folder (nodes started at once on one machine would otherwise
race for the same socket names in one session folder) and a small object store: records never
travel through it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD_ADDRESS = "127.0.0.4"
FAST_HEALTH = {
    "health_check_period_ms": 250,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 500,
}
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's least
START_TIMEOUT_S = 60.0


class ClusterError(RuntimeError):
    pass


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, whichever session each leads (Ray's workers lead
    their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, i = [pid], 0
    while i < len(found):
        found.extend(children.get(found[i], []))
        i += 1
    return found


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class LoopbackCluster:
    """`with LoopbackCluster() as cluster:` a head on HEAD_ADDRESS (no CPUs: nothing is placed
    there unless asked), then `cluster.add_node("127.0.0.2", {"vocoder": 1})` for each node,
    `cluster.kill_node(address)` for a power loss. Stops every node it started."""

    def __init__(self, head: str = HEAD_ADDRESS, system_config: dict | None = None) -> None:
        self.head = head
        self.port = _free_port(head)
        self.system_config = FAST_HEALTH if system_config is None else system_config
        self.root = Path(tempfile.mkdtemp(prefix="omni-ray-"))
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self._env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")

    @property
    def address(self) -> str:
        return f"{self.head}:{self.port}"

    def __enter__(self) -> LoopbackCluster:
        try:
            self._ray_start(
                self.head,
                "--head",
                f"--port={self.port}",
                "--num-cpus=0",
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_port(self.head)}",
                f"--system-config={json.dumps(self.system_config)}",
            )
            self.wait_for_nodes(1)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_node(self, address: str, resources: dict[str, float], num_cpus: int = 1) -> None:
        """A raylet on `address` advertising `resources`; returns once the head knows it."""
        alive = len(self.alive_nodes())
        self._ray_start(
            address,
            f"--address={self.address}",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources)}",
        )
        self.wait_for_nodes(alive + 1)

    def _ray_start(self, address: str, *args: str) -> None:
        if address in self.nodes:
            raise ClusterError(f"a node on {address} is already running")
        ray = Path(sys.executable).with_name("ray")
        with open(self.root / f"node-{address}.log", "wb") as log:
            self.nodes[address] = subprocess.Popen(
                [
                    str(ray),
                    "start",
                    "--block",
                    f"--node-ip-address={address}",
                    f"--temp-dir={self.root / address}",
                    f"--object-store-memory={OBJECT_STORE_BYTES}",
                    "--disable-usage-stats",
                    *args,
                ],
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive_nodes(self) -> list[str]:
        """The addresses of the nodes the head counts alive (a call to the GCS)."""
        from ray._raylet import GcsClient

        try:
            nodes = GcsClient(address=self.address).get_all_node_info(timeout=5)
        except Exception:  # the GCS is not up yet
            return []
        return [
            n.node_manager_address
            for n in nodes.values()
            if n.state == 0  # ALIVE
        ]

    def wait_for_nodes(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while len(self.alive_nodes()) < count:
            for address, process in self.nodes.items():
                if process.poll() is not None:
                    log = (self.root / f"node-{address}.log").read_text(errors="replace")
                    raise ClusterError(f"the Ray node on {address} exited:\n{log[-2000:]}")
            if time.monotonic() > deadline:
                raise ClusterError(f"fewer than {count} Ray nodes alive after {timeout:.0f} s")
            time.sleep(0.1)

    def kill_node(self, address: str) -> list[int]:
        """Every process of the node on `address` (its raylet, workers and what they started)
        killed at once, as a power loss would; the pids."""
        process = self.nodes.pop(address)
        pids = descendants(process.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(10)
        return pids

    def stop(self) -> None:
        """Stop every node: SIGTERM to each node's processes, SIGKILL to what is left after
        two seconds, then wait for them all to be gone; remove the nodes' folders."""
        pids = [pid for process in self.nodes.values() for pid in descendants(process.pid)]
        for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while (pids := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.05)
        for process in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)  # killed with its tree: only its exit status to collect
        self.nodes.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
