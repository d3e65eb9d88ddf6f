"""Stages on other hosts, placed and restarted by Ray (docs/scaling.md).

Each group of `cluster.groups` is one `StageHost` actor, created with the group's resources: Ray
puts it on a node that advertises them, and, when that node dies, on another (`max_restarts`).
The actor runs the group's share of the pipeline: a `Supervisor` of its stage processes, its
rings, and the bridges of the links that cross to other hosts. Records
never move through Ray; Ray places, watches and restarts.

`ClusterSupervisor` is the gateway host's supervisor: its own stages as ever, and the stage
hosts. It brings a group up in two steps, because every host must know where the others receive
their links before any sends: the actor's constructor opens its links (`ready()` says where),
then `start(peers)` connects them and starts the stages. A watcher asks each host for its
incarnation; a new one is a host Ray restarted elsewhere, which it brings up again and to which
the other hosts reconnect. Meanwhile the links' own silence (stages.bridge) has failed the calls
that host carried, within half a second, whatever Ray takes to notice.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shm import reap_stale
from stages.bridge import LinkTiming
from stages.config import ClusterConfig, PipelineConfig
from stages.rings import LOCAL, RingNames
from stages.supervisor import Progress, StageStartError, Supervisor

logger = logging.getLogger(__name__)


def links_to_json(endpoints: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """Link endpoints keyed "src>dst", as they travel in Ray's calls."""
    return {f"{src}>{dst}": endpoint for (src, dst), endpoint in endpoints.items()}


def links_from_json(endpoints: dict[str, str]) -> dict[tuple[str, str], str]:
    out = {}
    for link, endpoint in endpoints.items():
        src, _, dst = link.partition(">")
        out[(src, dst)] = endpoint
    return out


def link_timing(cluster: ClusterConfig) -> LinkTiming:
    return LinkTiming(cluster.heartbeat_ms / 1000, cluster.dead_after_ms / 1000)


def request(config: PipelineConfig, names: RingNames, timing: LinkTiming) -> dict[str, Any]:
    """What a stage host is created with: the pipeline's config, the names seen from it and
    its links' timing, in JSON's types (Ray keeps them to create the actor again after a
    restart)."""
    return {
        "config": config.model_dump(mode="json", include=set(PipelineConfig.model_fields)),
        "link_timing": [timing.heartbeat_s, timing.dead_after_s],
        "names": {
            "prefix": names.prefix,
            "replicas": [list(r) for r in names.replicas],
            "wake_yield": names.wake_yield,
            "hosts": [list(h) for h in names.hosts],
            "host": names.host,
        },
    }


def from_request(asked: dict[str, Any]) -> tuple[PipelineConfig, RingNames, LinkTiming]:
    n = asked["names"]
    names = RingNames(
        n["prefix"],
        tuple((role, count) for role, count in n["replicas"]),
        n["wake_yield"],
        tuple((instance, host) for instance, host in n["hosts"]),
        n["host"],
    )
    return PipelineConfig(**asked["config"]), names, LinkTiming(*asked["link_timing"])


def check_advertised(what: str, wanted: set[str], address: str) -> None:
    """StageStartError naming `what` and the resources of `wanted` that no live node of the
    cluster advertises: an actor asking for them would wait for ever."""
    import ray

    advertised: set[str] = set()
    for node in ray.nodes():
        if node["Alive"]:
            advertised |= set(node["Resources"])
    if missing := sorted(wanted - advertised):
        raise StageStartError(
            what,
            f"no node of the Ray cluster at {address} advertises {', '.join(missing)} "
            "(ray start --resources / --num-gpus)",
        )


class StageHost:
    """One group's host, as a Ray actor: its links are received on the node's address."""

    def __init__(self, asked: dict[str, Any]) -> None:
        import ray

        # a host that died on this node (or, in tests, on a node sharing its /dev/shm) left
        # segments of the same names, their owner gone
        reap_stale()
        config, names, timing = from_request(asked)
        self.address = ray.util.get_node_ip_address()  # the node's, as its raylet was given
        self.node_id = ray.get_runtime_context().get_node_id()
        self.supervisor = Supervisor(
            config, names=names, link_address=self.address, link_timing=timing
        )
        self.endpoints = self.supervisor.open_links()
        self.started = False

    def ready(self) -> dict[str, Any]:
        links = self.supervisor.links
        assert links is not None
        return {
            "address": self.address,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "incarnation": links.incarnation,
            "endpoints": links_to_json(self.endpoints),
            "started": self.started,
            "healthy": self.started and self.supervisor.healthy,
            "pids": {
                name: stage.process.pid
                for name, stage in self.supervisor.stages.items()
                if stage.process is not None
            },
        }

    def start(self, peers: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Send to the other hosts at `peers` and start the stages; each stage's facts."""
        assert self.supervisor.links is not None
        self.supervisor.links.connect(links_from_json(peers))
        self.supervisor.start()
        self.started = True
        return {name: stage.info for name, stage in self.supervisor.stages.items()}

    def reconnect(self, host: str, peers: dict[str, str]) -> None:
        """`host` was restarted: send to its new endpoints."""
        assert self.supervisor.links is not None
        self.supervisor.links.reconnect(host, links_from_json(peers))

    def stop(self) -> None:
        self.supervisor.stop()


@dataclass
class _Host:
    """The driver's view of one group's host."""

    group: str
    actor: Any
    incarnation: str = ""
    address: str = ""
    endpoints: dict[tuple[str, str], str] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> its facts
    up: bool = False
    restarts: int = 0


class ClusterSupervisor(Supervisor):
    """The gateway host's stages, and the groups of `cluster` on hosts Ray places.

    `start()` connects to the Ray cluster (unless this process already is), checks that every
    group's resources are advertised by some node, places the groups, waits for their stages
    and then for its own. `stop()` stops the stage hosts before its own stages."""

    def __init__(
        self,
        config: PipelineConfig,
        cluster: ClusterConfig,
        *,
        gateways: int = 1,
        log_level: int = logging.INFO,
        on_restart: Any = None,
        place_also: Callable[[], None] | None = None,
    ) -> None:
        """`place_also`: called once Ray is connected and before any stage starts, to place
        more on the cluster (gateway.cluster's gateway hosts) while they load."""
        names = RingNames.of(config, gateways).placed(cluster.placement, LOCAL)
        super().__init__(
            config,
            log_level=log_level,
            on_restart=on_restart,
            gateways=gateways,
            names=names,
            link_address=cluster.link_address,
            link_timing=link_timing(cluster),
        )
        self.cluster = cluster
        self.place_also = place_also
        self.hosts: dict[str, _Host] = {}
        self._ray_connected_here = False
        self._host_watcher: threading.Thread | None = None

    # -- start -----------------------------------------------------------------------------

    def start(self, progress: Progress | None = None) -> None:
        progress = progress or (lambda line: logger.info("%s", line))
        try:
            self._connect_ray()
            self._check_resources()
            if self.place_also is not None:
                self.place_also()
            self.open_links()
            self._place(progress)
            super().start(progress)
        except BaseException:
            self.stop()
            raise
        self._host_watcher = threading.Thread(
            target=self._watch_hosts, name="stage-host-watcher", daemon=True
        )
        self._host_watcher.start()

    def _connect_ray(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(
                address=self.cluster.address,
                namespace=self.cluster.namespace,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            self._ray_connected_here = True

    def _check_resources(self) -> None:
        """A group no node can take would wait for ever: say which, and what is missing."""
        for name, group in self.cluster.groups.items():
            wanted = set(group.resources) | ({"GPU"} if group.num_gpus else set())
            check_advertised(f"cluster group {name}", wanted, self.cluster.address)

    def _place(self, progress: Progress) -> None:
        import ray

        from stages.placement import PlacementError

        actor_class = ray.remote(StageHost)
        for name, group in self.cluster.groups.items():
            actor = actor_class.options(
                name=f"{self.names.prefix}-{name}",
                resources=group.resources or None,
                num_gpus=group.num_gpus,
                num_cpus=0,
                max_restarts=-1,  # on another node when its node dies
                max_task_retries=0,  # a call to a dead host fails at once; the watcher retries
            ).remote(request(self.config, self.names.on(name), self.link_timing))
            self.hosts[name] = _Host(name, actor)
        timeout = self.cluster.start_timeout_s
        for host in self.hosts.values():
            try:
                self._learn(host, ray.get(host.actor.ready.remote(), timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                raise PlacementError(
                    f"cluster group {host.group} was not placed within {timeout:.0f} s: no "
                    f"node with {self.cluster.groups[host.group].resources} is free"
                ) from None
            progress(f"stage host {host.group}: node {host.address}")
        for host in self.hosts.values():
            self._bring_up(host, progress)
        for host in self.hosts.values():
            assert self.links is not None  # open_links() made them: a group crosses to here
            self.links.connect(host.endpoints)

    def _learn(self, host: _Host, ready: dict[str, Any]) -> None:
        host.incarnation, host.address = ready["incarnation"], ready["address"]
        host.endpoints = links_from_json(ready["endpoints"])

    def _peers(self) -> dict[str, str]:
        """Where every host receives its links (this one's and each stage host's)."""
        assert self.links is not None
        peers = dict(self.links.endpoints)
        for host in self.hosts.values():
            peers.update(host.endpoints)
        return links_to_json(peers)

    def _bring_up(self, host: _Host, progress: Progress) -> None:
        import ray

        host.info = ray.get(
            host.actor.start.remote(self._peers()), timeout=self.cluster.start_timeout_s
        )
        host.up = True
        progress(f"stage host {host.group} on {host.address}: {', '.join(host.info)} ready")

    # -- watch -----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        links = self.links
        return (
            super().healthy
            and all(h.up for h in self.hosts.values())
            and (links is None or all(links.up(g) for g in self.hosts))
        )

    def stage_info(self, instance: str) -> dict[str, Any]:
        for host in self.hosts.values():
            if instance in host.info:
                return host.info[instance]
        return super().stage_info(instance)

    def _watch_hosts(self) -> None:
        import ray

        lost = (
            ray.exceptions.GetTimeoutError,
            ray.exceptions.RayActorError,
            ray.exceptions.ActorUnavailableError,
        )
        failed = (*lost, ray.exceptions.RayTaskError)
        interval = self.cluster.watch_interval_s
        while not self._stopping.wait(interval):
            for host in self.hosts.values():
                try:
                    ready = ray.get(host.actor.ready.remote(), timeout=max(1.0, 4 * interval))
                except lost as exc:
                    if host.up:
                        logger.error("stage host %s is unreachable: %s", host.group, exc)
                    host.up = False
                    continue
                if ready["incarnation"] == host.incarnation:
                    continue
                logger.warning(
                    "stage host %s was restarted on %s; bringing it up", host.group,
                    ready["address"],
                )  # fmt: skip
                host.up = False
                self._learn(host, ready)
                try:
                    self._bring_up(host, lambda line: logger.info("%s", line))
                except failed as exc:
                    logger.error("stage host %s did not come back: %s", host.group, exc)
                    host.incarnation = ""  # asked again at the next look
                    continue
                self._reconnect(host)
                host.restarts += 1
                if self.on_restart:
                    self.on_restart(host.group, host.restarts)

    def _reconnect(self, restarted: _Host) -> None:
        """Every other host sends to `restarted`'s new endpoints."""
        import ray

        assert self.links is not None
        self.links.reconnect(restarted.group, restarted.endpoints)
        peers = links_to_json(restarted.endpoints)
        calls = [
            h.actor.reconnect.remote(restarted.group, peers)
            for h in self.hosts.values()
            if h is not restarted
        ]
        ray.get(calls, timeout=self.cluster.start_timeout_s)

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the stage hosts (their stages, rings and bridges), then this host's."""
        self._stopping.set()
        if self._host_watcher is not None and self._host_watcher is not threading.current_thread():
            self._host_watcher.join(10)
        if self.hosts:
            import ray

            stops = {h.group: h.actor.stop.remote() for h in self.hosts.values()}
            for group, ref in stops.items():
                try:
                    ray.get(ref, timeout=self.config.supervisor.stop_timeout_s + 5)
                except Exception as exc:  # a dead host has nothing left to stop
                    logger.warning("stage host %s did not stop cleanly: %s", group, exc)
            for host in self.hosts.values():
                ray.kill(host.actor)
            self.hosts.clear()
        super().stop()
        if self._ray_connected_here:
            import ray

            ray.shutdown()
            self._ray_connected_here = False
