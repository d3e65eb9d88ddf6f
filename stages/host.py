"""One host's share of a pipeline placed across hosts, run by whoever places it: the stages
`RingNames.placed` puts on this host, under a supervisor, with the links to the other hosts.
(The Ray actor of docs/scaling.md runs the same; tests and loadtest.cluster_bench start it as
a process tree of its own, on an address of the loopback.)

`python -m stages.host`: stdin gives one JSON line (`request()`: the pipeline config, the
names seen from this host, the address its links are received on); it prints the endpoints
of the links into this host as one JSON line, reads the other hosts' endpoints as one JSON
line, starts its stages, prints "ready", and stops them when stdin closes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from shm import reap_stale
from stages.config import PipelineConfig
from stages.process_groups import kill_session
from stages.rings import GATEWAY, LOCAL, RingNames
from stages.supervisor import Supervisor


def links_to_json(endpoints: dict[tuple[str, str], str]) -> dict[str, str]:
    return {f"{src}>{dst}": endpoint for (src, dst), endpoint in endpoints.items()}


def links_from_json(endpoints: dict[str, str]) -> dict[tuple[str, str], str]:
    out = {}
    for link, endpoint in endpoints.items():
        src, _, dst = link.partition(">")
        out[(src, dst)] = endpoint
    return out


def request(config: PipelineConfig, names: RingNames, address: str) -> dict:
    """What a host is started with: the pipeline's config, the names seen from the host, the
    address its links are received on."""
    return {
        "config": config.model_dump(mode="json", include=set(PipelineConfig.model_fields)),
        "names": {
            "prefix": names.prefix,
            "replicas": [list(r) for r in names.replicas],
            "wake_yield": names.wake_yield,
            "hosts": [list(h) for h in names.hosts],
            "host": names.host,
        },
        "address": address,
    }


@dataclass
class TwoHosts:
    """A pipeline on the gateway's host (`here`, this process's supervisor) and one other host
    (`far`, a process tree of its own: `python -m stages.host` in a session of its own)."""

    here: Supervisor
    far: subprocess.Popen[str]
    far_host: str

    def lose_far_host(self) -> list[int]:
        """End every process of the far host at once, as a power loss would; their pids."""
        return kill_session(self.far.pid)


@contextlib.contextmanager
def two_hosts(
    config: PipelineConfig, far: Mapping[str, str], address: str = "127.0.0.2"
) -> Iterator[TwoHosts]:
    """Run `config`'s pipeline with the instances or roles of `far` on the one host it names,
    whose links are received on `address`; the rest, and the gateway's end, here. Stops
    both; what a far host that was lost left in shared memory is reaped."""
    hosts = set(far.values())
    if len(hosts) != 1 or LOCAL in hosts or GATEWAY in far:
        raise ValueError(f"{dict(far)}: stages for one other host, not the gateway")
    (far_host,) = hosts
    names = RingNames.fresh(
        {"vocoder": config.vocoder.replicas}, wake_yield=config.rings.wake_yield
    ).placed(far, LOCAL)
    here = Supervisor(config, names=names)
    process = subprocess.Popen(
        [sys.executable, "-m", "stages.host"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        endpoints_here = here.open_links()
        process.stdin.write(json.dumps(request(config, names.on(far_host), address)) + "\n")
        process.stdin.flush()
        answer = process.stdout.readline()
        if not answer:
            raise RuntimeError(f"host {far_host} did not start (exit code {process.wait(10)})")
        process.stdin.write(json.dumps(links_to_json(endpoints_here)) + "\n")
        process.stdin.flush()
        assert here.links is not None
        here.links.connect(links_from_json(json.loads(answer)))
        here.start()
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"host {far_host}'s stages did not start")
        yield TwoHosts(here, process, far_host)
    finally:
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            kill_session(process.pid)
            process.wait(10)
        process.stdout.close()
        here.stop()
        reap_stale()  # a far host that was lost left its segments, their owner gone


def main() -> None:
    asked = json.loads(sys.stdin.readline())
    n = asked["names"]
    names = RingNames(
        n["prefix"],
        tuple((role, count) for role, count in n["replicas"]),
        n["wake_yield"],
        tuple((instance, host) for instance, host in n["hosts"]),
        n["host"],
    )
    config = PipelineConfig(**asked["config"])
    with Supervisor(config, names=names, link_address=asked["address"]) as supervisor:
        print(json.dumps(links_to_json(supervisor.open_links())), flush=True)
        peers = json.loads(sys.stdin.readline())
        assert supervisor.links is not None
        supervisor.links.connect(links_from_json(peers))
        supervisor.start()
        print("ready", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
