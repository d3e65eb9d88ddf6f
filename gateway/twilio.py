"""Phone calls through Twilio Media Streams: the WebSocket a TwiML `<Connect><Stream>` opens to
/v1/telephony/twilio, speaking Twilio's messages (connected, start, media, mark, dtmf, stop
in; media, mark, clear out) as a Realtime session's transport.

The caller's audio comes as base64 μ-law 8 kHz in 20 ms `media` messages, decoded and brought
to 16 kHz for the VAD (gateway.g711). The agent's audio goes back the same way, paced so that
no more than `send_ahead_ms` of it is ever at Twilio unheard: a pause (the provisional
interruption policy, the hold at a first voiced frame) stops the sending, and a barge-in's
`clear` drops the little that was sent. Every 100 ms of it is followed by a `mark`; Twilio
echoes a mark once the audio before it has played, which is what the caller has heard, and
the conversation is cut to it on a barge-in as over WebRTC.

Auth as Twilio allows it: an API key in a custom parameter of the stream (TwiML
`<Parameter name="api_key" value="...">`), or the URL's `?api_key=`, checked at `start`,
before any audio is taken. Bad frames are logged and dropped; the call goes on. A `stop` or
a closed socket hangs up: the session ends in every stage.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import WSMsgType, web

from gateway.admission import TooManyCalls
from gateway.auth import AuthError
from gateway.fields import ProtocolError
from gateway.g711 import FRAME_BYTES, G711, RATE
from gateway.session import RealtimeSession, Reply, client_events
from stages.link import SessionsFull
from stages.messages import CALLER_RATE
from stages.tasks import cancel_and_wait

if TYPE_CHECKING:
    from gateway.calls import Gateway

logger = logging.getLogger(__name__)

PATH = "/v1/telephony/twilio"
MAX_PAYLOAD_BYTES = 10 * FRAME_BYTES  # 200 ms of μ-law in one media message at most
MAX_MESSAGE_BYTES = 64 * 1024
MARK_FRAMES = 5  # a mark after every 100 ms of the agent's audio
LAG_MARKS = 4  # marks in a row late by as much before the player is taken to be behind
LAG_STEP_S = 0.02  # a change in the player's lag smaller than this leaves the far end be
BAD_FRAMES_LOGGED = 5  # a call's first bad frames are logged each; the rest are counted
POLICY_VIOLATION = 1008  # the close code of a refused stream (RFC 6455)


class PlayerLag:
    """How far Twilio's player has fallen behind the send-ahead window's clock, from the
    lateness of the marks it echoes (how long after its audio was due to end each came back).

    A lateness has two parts: the mark's trip back, whose least is the floor, and the player
    behind the clock, which lasts until it runs dry. A mark that alone comes back late was
    held on its way (a busy event loop, here or at the phone), and the player is not behind
    for it; so the lag is what the last `LAG_MARKS` marks all had past the floor, and falls as
    soon as one of them comes back in time."""

    def __init__(self) -> None:
        self._floor: float | None = None
        self._recent: collections.deque[float] = collections.deque(maxlen=LAG_MARKS)
        self.lag = 0.0  # the lag the far end was last moved by
        self.moves = 0  # how often the lag moved, and its largest: how steady the far end is
        self.most = 0.0

    def mark(self, late_s: float) -> float | None:
        """A mark came back `late_s` after its audio was due to end: the player's new lag,
        when it moved by `LAG_STEP_S` or more (else None)."""
        self._floor = late_s if self._floor is None else min(self._floor, late_s)
        self._recent.append(late_s)
        lasting = min(self._recent) - self._floor if len(self._recent) == LAG_MARKS else 0.0
        if abs(lasting - self.lag) < LAG_STEP_S:
            return None
        self.lag = lasting
        self.moves += 1
        self.most = max(self.most, lasting)
        return lasting

    def ran_dry(self) -> None:
        """The player ran out of audio and plays the next on arrival: no lag now."""
        self._recent.clear()
        self.lag = 0.0


@dataclass(frozen=True)
class Sent:
    """One 20 ms frame of a reply, as queued to go to Twilio."""

    response_id: str
    payload: bytes
    end: int  # bytes (8 kHz samples) of the reply sent once this frame is


class TwilioTransport:
    """A Realtime session's way to a phone caller through one Media Stream."""

    kind = "twilio"
    holds_audio = True  # its audio is paced out from here: a pause stops it at once

    def __init__(
        self,
        session: RealtimeSession,
        ws: web.WebSocketResponse,
        stream_sid: str,
        send_ahead_ms: int,
    ) -> None:
        self.session = session
        self.ws = ws
        self.stream_sid = stream_sid
        self.ahead_s = send_ahead_ms / 1000
        self.coder = G711("audio/pcmu", session.vocoder_rate)
        self._frames: collections.deque[Sent | str] = collections.deque()  # str: a reply's end
        self._partial = b""  # μ-law of the current reply short of a whole frame
        self._bytes_of: dict[str, int] = {}  # bytes of each reply queued so far
        self._heard_of: dict[str, int] = {}  # ... and heard, by the marks echoed
        # mark name -> (reply, bytes heard at it, when its audio ends by the send-ahead clock)
        self._marks: dict[str, tuple[str, int, float]] = {}
        # the echo canceller's far end: what was sent, decoded as the caller hears it, placed
        # when it plays by the send-ahead window's clock and Twilio's player's lag behind it
        self.played_rate = CALLER_RATE
        self._decoder = G711("audio/pcmu")
        self.player = PlayerLag()
        self._generation = 0  # marks of audio a clear dropped name an older one
        self._mark_seq = 0
        self._played_until = 0.0  # when all the audio sent so far will have played
        self._held = False
        self._wake = asyncio.Event()
        self._out: asyncio.Queue[str] = asyncio.Queue()  # messages to Twilio, in order
        self._writer = session.spawn(self._write_out(), f"twilio-write-{session.call_id}")
        self._sender = session.spawn(self._send_paced(), f"twilio-pace-{session.call_id}")

    # -- the session's Transport ------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        """A phone line takes no Realtime events: errors are logged, the rest dropped."""
        if event["type"] == "error":
            self.session.log.warning("error on the phone call: %s", event["error"]["message"])

    def play(self, reply: Reply, pcm: np.ndarray) -> None:
        assert reply.response_id is not None
        if reply.playback_start is None:  # its first audio: the coder starts afresh
            self.coder.reset()
            self._partial = b""
            reply.playback_start = time.monotonic()
        self._queue(reply.response_id, self.coder.encode(pcm))

    def audio_end(self, reply: Reply) -> None:
        assert reply.response_id is not None
        self._queue(reply.response_id, self.coder.flush(), last=True)

    def finish(self, reply: Reply) -> None:
        assert reply.response_id is not None
        self._frames.append(reply.response_id)
        self._wake.set()

    def hold(self, held: bool) -> None:
        self._held = held
        if not held:
            self._wake.set()

    def clear(self) -> None:
        """Barge-in: nothing more goes out, and Twilio drops what it has not played."""
        self._frames.clear()
        self._partial = b""
        self._held = False
        self._generation += 1
        self._played_until = time.monotonic()
        self.player.ran_dry()
        self.coder.reset()
        if self.session.played is not None:
            self.session.played.cut()
        self._write({"event": "clear", "streamSid": self.stream_sid})

    def heard_samples(self, reply: Reply) -> int:
        heard = self._heard_of.get(reply.response_id or "", 0)
        return heard * self.session.vocoder_rate // RATE

    async def close(self) -> None:
        await cancel_and_wait(self._sender)
        await cancel_and_wait(self._writer)
        if not self.ws.closed:
            await self.ws.close()

    # -- out --------------------------------------------------------------------------------

    def _queue(self, response_id: str, data: bytes, last: bool = False) -> None:
        data = self._partial + data
        whole = len(data) - len(data) % FRAME_BYTES
        if last and whole < len(data):  # the reply's end, padded with μ-law silence
            data += b"\xff" * (FRAME_BYTES - len(data) % FRAME_BYTES)
            whole = len(data)
        self._partial = data[whole:]
        for start in range(0, whole, FRAME_BYTES):
            end = self._bytes_of.get(response_id, 0) + FRAME_BYTES
            self._bytes_of[response_id] = end
            self._frames.append(Sent(response_id, data[start : start + FRAME_BYTES], end))
        self._wake.set()

    async def _send_paced(self) -> None:
        """Send the queued frames, never more than `ahead_s` ahead of what has played."""
        sent_of: dict[str, int] = collections.Counter()
        while True:
            if not self._frames or self._held:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.monotonic()
            if self._played_until < now:  # Twilio's player ran dry: it plays on arrival
                self._played_until = now
                self.player.ran_dry()
            if self._played_until - now > self.ahead_s:
                await asyncio.sleep(self._played_until - now - self.ahead_s)
                continue
            item = self._frames.popleft()
            if isinstance(item, str):  # a reply's end: its last mark
                self._mark(item, self._bytes_of.get(item, 0), done=True)
                sent_of.pop(item, None)
                continue
            sent_of[item.response_id] += 1
            payload = base64.b64encode(item.payload).decode()
            self._write(
                {"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}}
            )
            if self.session.played is not None:
                pcm = self._decoder.decode(item.payload)
                self.session.played.play_at(pcm, self._played_until + self.player.lag)
            self._played_until += len(item.payload) / RATE
            if sent_of[item.response_id] % MARK_FRAMES == 0:
                self._mark(item.response_id, item.end)

    def _mark(self, response_id: str, heard: int, done: bool = False) -> None:
        self._mark_seq += 1
        name = f"{'done' if done else 'm'}.{self._generation}.{self._mark_seq}"
        self._marks[name] = (response_id, heard, self._played_until)
        self._write({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    def marked(self, name: str) -> None:
        """Twilio echoed a mark: the audio before it has played (or was cleared)."""
        kind, _, rest = name.partition(".")
        generation = rest.partition(".")[0]
        entry = self._marks.pop(name, None)
        if entry is None or generation != str(self._generation):
            return  # one of audio a clear dropped: not heard
        response_id, heard, due = entry
        self._follow_player(due)
        self._heard_of[response_id] = max(self._heard_of.get(response_id, 0), heard)
        if kind == "done":  # heard to its end: nothing more is asked of it
            self._bytes_of.pop(response_id, None)
            self._heard_of.pop(response_id, None)
            self.session.playback_done(response_id)

    def _follow_player(self, due: float) -> None:
        """A mark came back whose audio was due to end at `due` by the send-ahead clock: the
        far end's audio not yet played moves with the player's lag."""
        before = self.player.lag
        lag = self.player.mark(time.monotonic() - due)
        if lag is not None and self.session.played is not None:
            self.session.played.shift_from(due + before, lag - before)

    def _write(self, message: dict[str, Any]) -> None:
        self._out.put_nowait(json.dumps(message))

    async def _write_out(self) -> None:
        try:
            while True:
                await self.ws.send_str(await self._out.get())
        except (ConnectionError, RuntimeError):
            await self.session.close("the phone stream's socket failed")


class StreamRefused(Exception):
    """A stream turned away before its call began; the socket closes with this reason."""

    def __init__(self, reason: str, code: int = POLICY_VIOLATION) -> None:
        super().__init__(reason)
        self.code = code


class BadFrames:
    """A call's bad frames: the first few logged each, all of them counted."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0

    def drop(self, why: str) -> None:
        self.count += 1
        if self.count <= BAD_FRAMES_LOGGED:
            logger.warning("%s: a bad frame was dropped: %s", self.where, why)


async def serve_stream(
    gateway: Gateway, request: web.Request, ws: web.WebSocketResponse, address: str | None
) -> None:
    """Run a prepared Media Stream WebSocket as a phone call, until a `stop` or the socket
    closes; a stream refused at `start` is closed with the reason why."""
    bad = BadFrames(f"phone stream from {address}")
    try:
        call, transport = await _begin(gateway, request, ws, address, bad)
    except StreamRefused as exc:
        logger.warning("phone stream from %s refused: %s", address, exc)
        await ws.close(code=exc.code, message=str(exc).encode()[:120])
        return
    reason = "the phone stream's socket closed"
    decoder = G711("audio/pcmu")
    try:
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                bad.drop(f"a {msg.type.name} frame (Twilio sends JSON text)")
                continue
            event = _message(msg.data, bad)
            if event is None:
                continue
            if event.get("event") == "stop":
                reason = "hung up (stop)"
                break
            try:
                _take(event, call, transport, decoder, bad)
            except Exception:  # one message must never end the call
                call.log.exception("handling a %r message failed", event.get("event"))
    finally:
        if bad.count:
            call.log.warning("%d bad frame(s) dropped in this call", bad.count)
        await call.close(reason)


def _take(
    event: dict[str, Any],
    call: RealtimeSession,
    transport: TwilioTransport,
    decoder: G711,
    bad: BadFrames,
) -> None:
    """One message of the stream, after its start."""
    kind = event["event"]
    if kind == "media":
        if (audio := _media(event, bad)) is not None:
            call.feed_audio(decoder.decode(audio))
    elif kind == "mark":
        mark = event.get("mark")
        name = mark.get("name") if isinstance(mark, dict) else None
        if isinstance(name, str):
            transport.marked(name)
        else:
            bad.drop("a mark without a name")
    elif kind == "dtmf":
        dtmf = event.get("dtmf")
        digit = dtmf.get("digit") if isinstance(dtmf, dict) else None
        call.log.info("the caller pressed %r (DTMF is not passed to the agent)", digit)
    elif kind not in ("connected", "start"):
        bad.drop(f"an unknown event {kind!r}")


async def _begin(
    gateway: Gateway,
    request: web.Request,
    ws: web.WebSocketResponse,
    address: str | None,
    bad: BadFrames,
) -> tuple[RealtimeSession, TwilioTransport]:
    """Read up to the stream's `start`, check its key and profile, and open its session."""
    cfg = gateway.config.gateway.telephony
    start = await _until_start(ws, cfg.start_timeout_s, bad)
    stream_sid = start.get("streamSid")
    if not isinstance(stream_sid, str) or not stream_sid:
        raise StreamRefused("the start message has no streamSid")
    params = start.get("customParameters") or {}
    if not isinstance(params, dict):
        raise StreamRefused("customParameters must be an object")
    key = params.get(cfg.key_parameter) or request.query.get(cfg.key_parameter)
    try:
        gateway.admission.check_auth_rate(address)
        if gateway.auth.enabled and not isinstance(key, str):
            raise AuthError(f"no API key: pass it as the stream parameter {cfg.key_parameter!r}")
        grant = gateway.auth.check_key(key or "")
    except TooManyCalls as exc:
        raise StreamRefused(f"too many failed keys: {exc}") from None
    except AuthError as exc:
        gateway.admission.auth_failed(address)
        raise StreamRefused(str(exc)) from None
    name = params.get(cfg.profile_parameter) or ("default" if "default" in cfg.profiles else None)
    if name is not None and name not in cfg.profiles:
        raise StreamRefused(f"no profile {name!r} (gateway.telephony.profiles)")
    try:
        call = gateway.open_session("tel", grant, None, address)
    except (SessionsFull, TooManyCalls) as exc:
        raise StreamRefused(f"no room for the call: {exc}", code=1013) from None
    except ProtocolError as exc:
        raise StreamRefused(f"the session cannot be used: {exc}") from None
    call.log.info("phone call %s (stream %s), profile %s", start.get("callSid"), stream_sid, name)
    transport = TwilioTransport(call, ws, stream_sid, cfg.send_ahead_ms)
    call.bind(transport)
    call.start()
    if name is not None:  # as a session.update would (checked as the gateway started)
        client_events.session_update(call, {"session": cfg.profiles[name]}, None)
    return call, transport


async def _until_start(
    ws: web.WebSocketResponse, timeout_s: float, bad: BadFrames
) -> dict[str, Any]:
    """The `start` message's `start` object; what comes before it (`connected`, media sent
    early) is passed over."""
    try:
        async with asyncio.timeout(timeout_s):
            async for msg in ws:
                if msg.type is not WSMsgType.TEXT:
                    continue
                event = _message(msg.data, bad)
                if event is not None and event.get("event") == "start":
                    start = event.get("start")
                    if not isinstance(start, dict):
                        raise StreamRefused("the start message has no start object")
                    return start
    except TimeoutError:
        raise StreamRefused(f"no start message within {timeout_s:g} s") from None
    raise StreamRefused("the stream closed before its start message")


def _message(text: str, bad: BadFrames) -> dict[str, Any] | None:
    if len(text) > MAX_MESSAGE_BYTES:
        bad.drop(f"a message of {len(text)} bytes")
        return None
    try:
        event = json.loads(text)
    except ValueError:
        bad.drop("not JSON")
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        bad.drop("a message with no 'event'")
        return None
    return event


def _media(event: dict[str, Any], bad: BadFrames) -> bytes | None:
    """A media message's μ-law bytes, or None (dropped) if it is not one Twilio sends."""
    media = event.get("media")
    if not isinstance(media, dict) or not isinstance(media.get("payload"), str):
        bad.drop("a media message without a payload")
        return None
    if media.get("track", "inbound") != "inbound":
        return None  # only the caller's track is heard
    try:
        audio = base64.b64decode(media["payload"], validate=True)
    except (binascii.Error, ValueError):
        bad.drop("a payload that is not base64")
        return None
    if not 0 < len(audio) <= MAX_PAYLOAD_BYTES:
        bad.drop(f"a payload of {len(audio)} bytes (20 ms of μ-law is {FRAME_BYTES})")
        return None
    return audio


def check_profiles(gateway: Gateway) -> None:
    """Each profile must be a session the gateway can open: checked as it starts."""
    for name, profile in gateway.config.gateway.telephony.profiles.items():
        gateway.check_session_config(profile, f"gateway.telephony.profiles.{name}")
