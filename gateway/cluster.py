"""Gateway hosts beyond the driver's, placed and restarted by Ray (docs/scaling.md).

With `cluster.gateway_hosts` > 1, `omni-gateway start` is gateway host 0 and the driver: it runs
the load exchange and asks Ray for the other hosts, each a `GatewayHost` actor on a node that
advertises `cluster.gateway_resources`. A gateway host runs the whole pipeline of the
configuration on its node (its own stages, rings and gateway processes, serving on the node's
address), so a call needs nothing of another host once its signaling has reached it
(gateway.hosts). When a node dies, its calls end with it, the other hosts forget it within
`gateway.hosts.STALE_S`, and Ray creates its actor again on another node that advertises the
resources: the constructor brings the host up there and it rejoins the table.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from gateway.config import OmniConfig
from gateway.hosts import ClusterMember
from stages.cluster import check_advertised
from stages.config import ClusterConfig
from stages.supervisor import Progress, StageStartError

logger = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 60.0
_ANY = ("0.0.0.0", "::", "")


class LoadExchange:
    """The ZeroMQ forwarder that carries every host's load to every gateway process: hosts
    publish to one endpoint, processes subscribe to the other (both on `address`)."""

    def __init__(self, address: str) -> None:
        import zmq

        self._context = zmq.Context()
        self._front = self._context.socket(zmq.XSUB)
        self._back = self._context.socket(zmq.XPUB)
        self._control = self._context.socket(zmq.PAIR)
        for sock in (self._front, self._back, self._control):
            sock.setsockopt(zmq.LINGER, 0)
        self.publish = _bind(self._front, address)
        self.subscribe = _bind(self._back, address)
        control = f"inproc://load-exchange-{id(self)}"
        self._control.bind(control)
        self._thread = threading.Thread(
            target=self._run, args=(control,), name="load-exchange", daemon=True
        )
        self._thread.start()

    def _run(self, control: str) -> None:
        import zmq

        steer = self._context.socket(zmq.PAIR)
        steer.connect(control)
        try:
            zmq.proxy_steerable(self._front, self._back, None, steer)
        except zmq.ContextTerminated:
            pass
        finally:
            steer.close(0)

    def stop(self) -> None:
        self._control.send(b"TERMINATE")
        self._thread.join(5)
        for sock in (self._front, self._back, self._control):
            sock.close(0)
        self._context.term()


def _bind(sock: Any, address: str) -> str:
    port = sock.bind_to_random_port(f"tcp://{address}")
    return f"tcp://{address}:{port}"


def config_on_node(config: OmniConfig, address: str) -> OmniConfig:
    """`config` as a gateway host on the node at `address` runs it: serving on the node's
    address (unless on every interface), offering it as the ICE candidate when the
    configuration names candidates, and with every stage on the node."""
    gateway = config.gateway
    update: dict[str, Any] = {}
    if gateway.host not in _ANY:
        update["host"] = address
    if gateway.ice_host_addresses is not None:
        update["ice_host_addresses"] = [address]
    return config.model_copy(update={"gateway": gateway.model_copy(update=update), "cluster": None})


class GatewayHost:
    """One gateway host as a Ray actor: the constructor starts its stages and serves; Ray
    runs it again on another node when its node dies."""

    def __init__(self, asked: dict[str, Any]) -> None:
        import ray

        from shm import reap_stale
        from stages.supervisor import Supervisor

        reap_stale()  # what a host that died on this node (or beside it, in tests) left
        self.address = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        config = config_on_node(OmniConfig.model_validate(asked["config"]), self.address)
        self.member = ClusterMember(
            asked["host"],
            self.address,
            bytes.fromhex(asked["secret"]),
            asked["publish"],
            asked["subscribe"],
            secrets.token_hex(8),
        )
        self.supervisor = Supervisor(config, gateways=config.gateway.processes)
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._failed: BaseException | None = None
        self._listening = threading.Event()
        self.supervisor.start()
        try:
            self._thread = threading.Thread(
                target=asyncio.run, args=(self._serve(config),), name="gateway", daemon=True
            )
            self._thread.start()
            if not self._listening.wait(LISTEN_TIMEOUT_S) or self._failed is not None:
                raise RuntimeError(
                    f"gateway host {self.member.host} did not start listening: {self._failed}"
                )
        except BaseException:
            self.supervisor.stop()
            raise

    async def _serve(self, config: OmniConfig) -> None:
        from gateway.server import gateway_processes

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with gateway_processes(
                config, self.supervisor, lambda line: logger.info("%s", line), member=self.member
            ) as (base, _):
                port = base.rsplit(":", 1)[1]
                self.url = f"http://{self.address}:{port}"
                self._listening.set()
                await self._stop.wait()
        except BaseException as exc:
            self._failed = exc
            self._listening.set()
            raise

    def ready(self) -> dict[str, Any]:
        return {
            "host": self.member.host,
            "address": self.address,
            "node_id": self.node_id,
            "url": self.url,
            "pid": os.getpid(),
            "incarnation": self.member.incarnation,
            "prefix": self.supervisor.names.prefix,  # of its segments
            "healthy": self.supervisor.healthy and self._thread.is_alive(),
        }

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
        self.supervisor.stop()


@dataclass
class _Placed:
    host: int
    actor: Any
    ready: dict[str, Any]


class GatewayHosts:
    """The driver's side: the exchange, host 0's membership, and the other hosts' actors."""

    def __init__(self, config: OmniConfig, cluster: ClusterConfig) -> None:
        self.config = config
        self.cluster = cluster
        self.secret = secrets.token_bytes(32)
        self.exchange: LoadExchange | None = LoadExchange(cluster.link_address)
        self.member = ClusterMember(
            0,
            cluster.link_address,
            self.secret,
            self.exchange.publish,
            self.exchange.subscribe,
            secrets.token_hex(8),
        )
        self.asked = {
            "config": config.model_dump(mode="json"),
            "secret": self.secret.hex(),
            "publish": self.exchange.publish,
            "subscribe": self.exchange.subscribe,
        }
        self.placed: list[_Placed] = []

    def place(self) -> None:
        """Ask Ray for hosts 1.., without waiting for them (Ray must be connected:
        ClusterSupervisor's `place_also`, so they load their models while this host's stages
        load theirs); `wait` then waits for them."""
        import ray

        try:
            wanted = set(self.cluster.gateway_resources)
            check_advertised("gateway hosts", wanted, self.cluster.address)
            actor_class = ray.remote(GatewayHost)
            for host in range(1, self.cluster.gateway_hosts):
                actor = actor_class.options(
                    name=f"gateway-host-{host}-{self.member.incarnation}",
                    resources=self.cluster.gateway_resources,
                    num_cpus=0,
                    max_restarts=-1,  # on another node when its node dies
                    max_task_retries=0,
                ).remote(self.asked | {"host": host})
                self.placed.append(_Placed(host, actor, {}))
        except BaseException:
            self.stop()
            raise

    def wait(self, progress: Progress) -> None:
        """Wait until every placed host serves; StageStartError naming one that does not."""
        import ray

        timeout = self.cluster.start_timeout_s
        try:
            for placed in self.placed:
                try:
                    placed.ready = ray.get(placed.actor.ready.remote(), timeout=timeout)
                except ray.exceptions.GetTimeoutError:
                    raise StageStartError(
                        f"gateway host {placed.host}",
                        f"not serving within {timeout:.0f} s: no node with "
                        f"{self.cluster.gateway_resources} is free",
                    ) from None
                except ray.exceptions.RayActorError as exc:  # its start failed there
                    raise StageStartError(f"gateway host {placed.host}", str(exc)) from None
                progress(f"gateway host {placed.host}: {placed.ready['url']}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every host (a dead one has nothing left to stop), then the exchange. Safe to
        call twice."""
        if self.placed:
            import ray

            stops = {p.host: p.actor.stop.remote() for p in self.placed}
            for host, ref in stops.items():
                try:
                    ray.get(ref, timeout=self.config.supervisor.stop_timeout_s + 35)
                except Exception as exc:
                    logger.warning("gateway host %d did not stop cleanly: %s", host, exc)
            for placed in self.placed:
                ray.kill(placed.actor)
            self.placed.clear()
        if self.exchange is not None:
            self.exchange.stop()
            self.exchange = None
