"""The calls one gateway process carries: admission of new sessions (WebRTC calls, WebSockets,
speech requests), the pipeline link they share, and stage records routed to their owners."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from gateway import aiortc_tuning
from gateway.admission import Admission
from gateway.auth import Authenticator, Grant, ScrapeAuth
from gateway.config import OmniConfig
from gateway.hosts import ClusterMember, HostLoad, HostRouter
from gateway.loopwatch import LoopWatch, freeze_startup_objects
from gateway.metrics import GatewayMetrics
from gateway.opus import opus_rate_for
from gateway.playout import PLAYOUT_RATE
from gateway.prompt_limit import PromptLimit
from gateway.protocol import SessionConfig, TurnDetection
from gateway.session import RealtimeSession
from gateway.siblings import Siblings, call_id
from gateway.speech import SpeechRequest
from gateway.tools import check_servers
from gateway.trace import StageTrace
from gateway.tracing import Tracing
from gateway.turns.models import TurnModels
from gateway.webrtc import WebRTCTransport
from stages.envelope import Envelope
from stages.link import PipelineLink, SessionsFull
from stages.messages import CALLER_RATE, CancelAck
from stages.rings import GATEWAY, RingNames
from stages.stops import made_stale
from stages.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

# several gateway processes: their metrics meet in files (prometheus_client's multiprocess mode,
# which `omni-gateway start` turns on before anything imports prometheus_client)
MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ


class Gateway:
    """Sessions in progress (WebRTC calls, WebSockets, speech requests) and the pipeline link
    they share: one gateway process's.

    `instance` names the process among the service's (`gateway.processes`); with more than
    one, `socket_dir` holds their sockets for the requests they pass each other
    (gateway.siblings) and `signing_key` is the one their client secrets share. `member`:
    this host's place in a cluster of gateway hosts (gateway.hosts), whose calls it routes.
    """

    def __init__(
        self,
        config: OmniConfig,
        names: RingNames,
        vocoder_rate: int,
        is_ready: Callable[[], bool],
        *,
        instance: str = GATEWAY,
        socket_dir: str | Path | None = None,
        signing_key: bytes | None = None,
        member: ClusterMember | None = None,
    ) -> None:
        self.config = config
        self.names = names
        self.instance = instance
        self.index = names.gateways.index(instance)
        self.socket_dir = socket_dir
        self.vocoder_rate = vocoder_rate
        self.is_ready = is_ready
        self.member = member
        if member is not None:
            signing_key = member.client_secret_key
        self.auth = Authenticator(config.gateway.auth, signing_key=signing_key)
        self.admission = Admission(config.gateway.limits)
        self.scrape_auth = ScrapeAuth(config.gateway.metrics)
        self.metrics = GatewayMetrics()
        self.calls: dict[str, RealtimeSession] = {}
        self.by_session: dict[int, RealtimeSession | SpeechRequest] = {}
        self.link: PipelineLink | None = None
        self.siblings: Siblings | None = None
        self.hosts: HostRouter | None = None
        self.public_url: str | None = None  # where other hosts reach it, once it listens
        self.loop: asyncio.AbstractEventLoop | None = None
        self.trace: StageTrace | None = None
        self.tracing: Tracing | None = None  # OpenTelemetry, when gateway.tracing is on
        self.watch: LoopWatch | None = None
        self.turn_models: TurnModels | None = None
        self.prompt_limit = PromptLimit(config.reasoning)
        # replaced, never changed in place: a reader thread walks the tuple it read
        self._stage_observers: tuple[Callable[[Envelope], None], ...] = ()

    def add_stage_observer(self, observer: Callable[[Envelope], None]) -> None:
        """Have `observer` see every stage record this process receives, before it is routed.

        It runs on a ring reader thread, before the hop to the loop: it must be quick and must
        not touch the loop's state (hand work over with `loop.call_soon_threadsafe`). One that
        raises is logged, and the record is routed all the same."""
        self._stage_observers = (*self._stage_observers, observer)

    # reader thread -> loop
    def _on_stage_event(self, event: Envelope) -> None:
        assert self.loop is not None
        for observer in self._stage_observers:
            try:
                observer(event)
            except Exception:
                logger.exception(
                    "stage observer %r failed on a %s record", observer, event.kind.name
                )
        if self.trace is not None:
            self.trace.record(event, *self.whose(event))
        self.loop.call_soon_threadsafe(self._route, event)

    def whose(self, event: Envelope) -> tuple[str | None, int | None]:
        """The call an event is for, and for a CANCEL_ACK when its CANCEL was sent (read on a
        reader thread: a dict lookup, no state changed)."""
        call = self.by_session.get(event.session)
        if not isinstance(call, RealtimeSession):
            return None, None
        sent = None
        if isinstance(event.msg, CancelAck):
            sent = call.cancels.sent.get(event.msg.cancel_id)
        return call.call_id, sent

    def _route(self, event: Envelope) -> None:
        owner = self.by_session.get(event.session)
        if owner is None or self.link is None:
            return
        # the ring drops what a cancel made stale; this drops what was on its way to the loop
        current = self.link.control.epoch(event.session)
        if made_stale(event, current):
            return
        owner.on_stage_event(event)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: attach to the rings before serving; afterwards close every call, then
        what was acquired, in reverse. A step that fails is logged and the rest still run."""
        self.loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as cleanup:
            if self.config.gateway.trace_dir is not None:
                trace_path = Path(self.config.gateway.trace_dir) / f"{self.instance}.trace"
                self.trace = StageTrace(trace_path)
                cleanup.callback(_logged, self.trace.close)
            if self.config.gateway.tracing.otlp_endpoint is not None:
                self.tracing = Tracing(self.config.gateway.tracing, self.instance)
                # after the calls are closed (their turns end then): the last spans go out
                cleanup.push_async_callback(_logged_async, asyncio.to_thread(self.tracing.shutdown))
            self.turn_models = TurnModels(self.config.gateway.turns)
            cleanup.callback(_logged, self.turn_models.close)
            self.link = PipelineLink(self.names, self._on_stage_event, self.instance)
            cleanup.callback(_logged, self.link.close)
            if self.socket_dir is not None and len(self.names.gateways) > 1:
                siblings = self.siblings = Siblings(
                    self.names, self.instance, self.link.control, self.socket_dir
                )
                cleanup.push_async_callback(_logged_async, siblings.close())
            if self.member is not None:
                hosts = self.hosts = HostRouter(
                    self.member, self.load_here, publishes=self.instance == GATEWAY
                )
                routing = asyncio.create_task(hosts.run(), name="gateway-hosts")
                cleanup.push_async_callback(_logged_async, hosts.close())
                cleanup.push_async_callback(_logged_async, cancel_and_wait(routing))
            if MULTIPROCESS:
                rings = asyncio.create_task(self._update_ring_metrics(), name="ring-metrics")
                cleanup.push_async_callback(_logged_async, cancel_and_wait(rings))
            if self.config.gateway.media.gc_freeze:
                frozen = freeze_startup_objects()
                logger.info("%d objects of the start-up exempt from garbage collection", frozen)
            stall_ms = self.config.gateway.media.stall_report_ms
            watch = self.watch = LoopWatch(
                self.metrics.loop_lag,
                self.metrics.gc_pause,
                stall_ms / 1000 if stall_ms else None,
                busy=lambda: bool(self.calls),
            )
            watch.start()
            cleanup.push_async_callback(_logged_async, watch.stop())
            cleanup.push_async_callback(self._close_calls)
            yield

    def load_here(self) -> HostLoad | None:
        """This host's load, all its gateway processes', as the cluster's other hosts see it
        (None until it listens)."""
        if self.member is None or self.public_url is None or self.link is None:
            return None
        capacity = self.config.gateway.max_calls
        held = len(self.link.control.open_sessions())
        return HostLoad(
            self.member.host,
            self.public_url,
            max(0, capacity - held),
            capacity,
            self.is_ready(),
            self.member.incarnation,
        )

    async def _close_calls(self) -> None:
        for call in list(self.calls.values()):
            await _logged_async(call.close("gateway shutting down"))

    async def _update_ring_metrics(self) -> None:
        """With several processes a scrape reaches one of them: each keeps its rings'
        figures current."""
        while True:
            self.update_ring_metrics()
            await asyncio.sleep(1.0)

    def session_config(self) -> SessionConfig:
        """A new session's settings: the configuration's defaults."""
        gw = self.config.gateway
        return SessionConfig(
            voice=self.config.vocoder.voice,
            model=self.config.reasoning.model,
            instructions=self.config.reasoning.system_prompt,
            turn_detection=TurnDetection(**gw.turns.detection.model_dump()),
            max_output_tokens=gw.max_output_tokens or "inf",
        )

    def check_session_config(self, session: Any, param: str = "session") -> SessionConfig:
        """The settings `session` would give a new session; ProtocolError if refused."""
        config = self.session_config().updated(session, param)
        if self.turn_models is not None:
            self.turn_models.check(config, param)
        check_servers(config.tools, self.config.gateway.tools, param)
        self.prompt_limit.check(config, param)
        return config

    def open_session(
        self, prefix: str, grant: Grant, model: str | None, address: str | None = None
    ) -> RealtimeSession:
        """Admit a new Realtime session from `address`; raises SessionsFull, TooManyCalls
        for a client past its own limits, or ProtocolError for settings that cannot be used."""
        assert self.link is not None
        if len(self.calls) >= self.config.max_calls_per_process:
            raise SessionsFull(f"{len(self.calls)} calls in progress, the configured maximum")
        holder = self.admission.check(grant, address)
        config = self.session_config()
        if grant.session is not None:
            config.apply(grant.session)
        if model:
            config.model = model
        models = self.turn_models
        assert models is not None
        models.check(config)
        session = self.link.open_session()
        gw = self.config.gateway
        call = RealtimeSession(
            call_id(prefix, self.index, self.member and self.member.host),
            self.link,
            session,
            self.vocoder_rate,
            self.metrics,
            config,
            on_closed=self._forget,
            turns=gw.turns,
            turn_models=models,
            tracing=self.tracing,
            tools=gw.tools,
            speech_in=self.config.reasoning.speech_in is not None,
            prompt_limit=self.prompt_limit,
            echo_cancel=gw.media.echo_cancel,
        )
        self.calls[call.call_id] = call
        self.admission.admit(call.call_id, holder)
        self.by_session[session] = call
        self.metrics.sessions.set(len(self.calls))
        if self.watch is not None:
            self.watch.wake()
        return call

    def _ice_config(self) -> RTCConfiguration:
        return RTCConfiguration(
            iceServers=[RTCIceServer(urls=u) for u in self.config.gateway.ice_servers]
        )

    async def answer(
        self,
        offer_sdp: str,
        grant: Grant,
        session: dict[str, Any] | None = None,
        address: str | None = None,
    ) -> tuple[str, str]:
        """Create a call from an SDP offer; (call_id, answer SDP). Raises SessionsFull,
        TooManyCalls, ProtocolError for refused settings, or ValueError for an offer that is
        not usable. A call whose ICE does not connect in gateway.limits.connect_timeout_s is
        closed."""
        if session is not None:
            self.check_session_config(session)
        call = self.open_session("rtc", grant, None, address)
        if session is not None:
            call.config.apply(session)
        pc = RTCPeerConnection(self._ice_config())
        libopus = aiortc_tuning.opus_codec() == "opuslib"
        # with libopus, agent audio is played (and coded) at the Opus rate nearest the
        # vocoder's, caller audio decoded straight to what the VAD takes
        playout_rate = opus_rate_for(self.vocoder_rate) if libopus else PLAYOUT_RATE
        transport = WebRTCTransport(
            call, pc, playout_rate, connect_timeout_s=self.config.gateway.limits.connect_timeout_s
        )
        call.bind(transport)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
            audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
            if not audio:
                raise OfferError("the offer has no audio media section (m=audio)")
            if libopus:
                for transceiver in audio:
                    aiortc_tuning.decode_at(transceiver.receiver, CALLER_RATE)
            await pc.setLocalDescription(await pc.createAnswer())
        except OfferError as exc:
            await call.close("bad offer")
            raise ValueError(str(exc)) from exc
        except Exception as exc:  # what aiortc's parser says is for the log, not the client
            call.log.info("offer refused: %s: %s", type(exc).__name__, exc)
            await call.close("bad offer")
            raise ValueError(
                "the SDP offer cannot be answered: a WebRTC offer has an audio media section "
                "with ICE credentials (a=ice-ufrag, a=ice-pwd), a DTLS fingerprint and Opus"
            ) from exc
        call.start()
        return call.call_id, pc.localDescription.sdp

    def open_speech_request(self) -> SpeechRequest:
        """A pipeline session for one /v1/audio/speech request; raises SessionsFull."""
        assert self.link is not None
        request = SpeechRequest(self.link, self.link.open_session(), self.vocoder_rate)
        self.by_session[request.session] = request
        return request

    def close_speech_request(self, request: SpeechRequest) -> None:
        assert self.link is not None
        if not request.done:
            self.link.cancel(request.session, reason="client_gone")
        self.by_session.pop(request.session, None)
        self.link.close_session(request.session)

    def _forget(self, call: RealtimeSession) -> None:
        self.calls.pop(call.call_id, None)
        self.admission.release(call.call_id)
        self.by_session.pop(call.session, None)
        self.metrics.sessions.set(len(self.calls))

    def update_ring_metrics(self) -> None:
        if self.link is None:
            return
        for name, ring in self.link.rings().items():
            stats = ring.stats()
            self.metrics.ring_bytes_used.labels(name).set(stats["bytes_used"])
            self.metrics.ring_full.labels(name).set(stats["full"])
            self.metrics.ring_skipped.labels(name).set(stats["skipped"])


class OfferError(ValueError):
    """An SDP offer that parses but is not one this gateway can answer; its message says why."""


def _logged(step: Callable[[], Any]) -> None:
    """Run one shutdown step; an error is logged, and shutdown goes on."""
    try:
        step()
    except Exception:
        logger.exception("shutdown: %s failed", getattr(step, "__qualname__", step))


async def _logged_async(step: Coroutine[Any, Any, Any]) -> None:
    try:
        await step
    except Exception:
        logger.exception("shutdown: %s failed", step.__qualname__)
