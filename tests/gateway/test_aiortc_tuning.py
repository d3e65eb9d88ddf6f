"""gateway.aiortc_tuning: same audio levels as aiortc, a loud verify(), lower loopback latency."""

from __future__ import annotations

import asyncio
import queue
import statistics
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import aioice.ice
import aiortc.rtcrtpreceiver
import aiortc.rtp
import numpy as np
import pytest
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection
from aiortc.codecs.opus import OpusEncoder
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtcrtpreceiver import RemoteStreamTrack, RTCRtpReceiver
from aiortc.rtcrtpsender import RTCRtpSender
from av import AudioFrame

from gateway import aiortc_tuning
from loadtest.loss_bench import ToneBursts, one_way_ms, variant

RATE = 48_000
FRAME = 960


@pytest.fixture
def stock_aiortc() -> Iterator[None]:
    """Start from stock aiortc and leave the tuning as it was found."""
    was_applied, prefetch = aiortc_tuning.applied(), aiortc_tuning.audio_prefetch()
    reads = aiortc_tuning.udp_reads_per_wake()
    aiortc_tuning.restore()
    yield
    aiortc_tuning.restore()
    if was_applied:
        aiortc_tuning.apply(prefetch, udp_reads_per_wake=reads)


def audio_frame(pcm: np.ndarray, layout: str) -> AudioFrame:
    frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=layout)
    frame.sample_rate = RATE
    return frame


def test_audio_level_matches_aiortc_on_random_frames() -> None:
    stock = aiortc_tuning.audio_level.STOCK
    rng = np.random.default_rng(7)
    for layout, channels in (("stereo", 2), ("mono", 1)):
        for _ in range(200):
            # Levels from digital silence to full scale, so every branch (clamps included) runs.
            scale = float(rng.choice([0.0, 0.5, 3.0, 100.0, 3000.0, 40000.0]))
            pcm = np.clip(rng.normal(0, scale, FRAME * channels), -32768, 32767).astype(np.int16)
            frame = audio_frame(pcm, layout)
            assert aiortc_tuning.compute_audio_level_dbov(frame) == stock(frame), (layout, scale)
    full_scale = audio_frame(np.full(FRAME * 2, -32768, np.int16), "stereo")
    assert aiortc_tuning.compute_audio_level_dbov(full_scale) == stock(full_scale) == 0


def test_audio_level_is_faster() -> None:
    frame = audio_frame(
        np.random.default_rng(1).integers(-3000, 3000, FRAME * 2, np.int16), "stereo"
    )

    def per_frame_us(fn: object, repeat: int) -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            fn(frame)  # type: ignore[operator]
        return (time.perf_counter() - start) / repeat * 1e6

    stock = min(per_frame_us(aiortc_tuning.audio_level.STOCK, 200) for _ in range(3))
    tuned = min(per_frame_us(aiortc_tuning.compute_audio_level_dbov, 2000) for _ in range(3))
    print(f"\naudio level per 20 ms stereo frame: stock {stock:.1f} µs, numpy {tuned:.1f} µs")
    assert tuned < stock


def _released(buffer: Any, sequence: list[int]) -> list[tuple[int, int | None]]:
    """(packet added, frame released or None) for one 20 ms Opus packet per frame."""
    from aiortc.rtp import RtpPacket

    out = []
    for seq in sequence:
        packet = RtpPacket(payload_type=111, sequence_number=seq, timestamp=seq * 960)
        packet._data = bytes([seq % 256])  # type: ignore[attr-defined]
        _, frame = buffer.add(packet)
        out.append((seq, None if frame is None else frame.timestamp // 960))
    return out


def test_a_lost_audio_packet_delays_the_call_for_a_moment_not_for_good(
    stock_aiortc: None,
) -> None:
    sent = [s for s in range(80) if s != 5]  # packet 5 lost
    stock = _released(aiortc.rtcrtpreceiver.JitterBuffer(capacity=16, prefetch=1), sent)
    # aiortc: the frames queued behind the hole stay queued, 14 packets (280 ms) for good
    assert [seq - frame for seq, frame in stock[-10:] if frame is not None] == [14] * 10

    aiortc_tuning.apply(audio_prefetch=1)
    tuned = _released(aiortc.rtcrtpreceiver.JitterBuffer(capacity=16, prefetch=4), sent)
    frames = [frame for _, frame in tuned if frame is not None]
    assert frames == sorted(set(frames))  # in order, none twice
    assert [seq - frame for seq, frame in tuned[10:]] == [1] * len(tuned[10:])  # back to 20 ms
    assert len(frames) >= len(sent) - 4  # the lost packet cost at most 3 frames beside it

    # reordering within 40 ms is waited for: every frame comes out, in order (the buffer then
    # holds one frame more, 20 ms, as aiortc's does; a few such and it trims back)
    swapped = list(range(40))
    swapped[7], swapped[8] = 8, 7
    late = _released(aiortc.rtcrtpreceiver.JitterBuffer(capacity=16, prefetch=4), swapped)
    assert [frame for _, frame in late if frame is not None] == list(range(38))


def test_with_prefetch_0_audio_is_released_as_it_arrives_in_order(stock_aiortc: None) -> None:
    """Each packet is a whole audio frame: released on arrival, not when the next one comes
    (stock aiortc holds 20 ms even at prefetch 0). A packet out of order holds the ones
    behind it back until it comes, or for LATE_PACKETS packets if it never does."""
    from aiortc.rtp import RtpPacket

    stock = _released(aiortc.rtcrtpreceiver.JitterBuffer(capacity=16, prefetch=0), [0, 1, 2])
    assert stock == [(0, None), (1, 0), (2, 1)]  # a packet's frame waits for the next packet

    aiortc_tuning.apply(audio_prefetch=0)
    buffer = aiortc.rtcrtpreceiver.JitterBuffer(capacity=16, prefetch=4)

    def released(sequence: list[int]) -> list[list[int]]:
        out = []
        for seq in sequence:
            packet = RtpPacket(payload_type=111, sequence_number=seq % 65536, timestamp=seq * 960)
            packet._data = bytes([seq % 256])  # type: ignore[attr-defined]
            _, frame = buffer.add(packet)
            frames = [] if frame is None else [frame]
            while (more := buffer.pop_ready()) is not None:
                frames.append(more)
            out.append([f.timestamp // 960 for f in frames])
        return out

    assert released([0, 1, 2]) == [[0], [1], [2]]
    assert released([4, 3, 5]) == [[], [3, 4], [5]]  # 3 came late: 4 waits for it
    # 6 lost: 7 and 8 wait, 9 is the third behind the hole, which is given up; 6 then too late
    assert released([7, 8, 9, 6, 10]) == [[], [], [7, 8, 9], [], [10]]
    buffer = aiortc.rtcrtpreceiver.JitterBuffer(capacity=16)  # sequence numbers wrapping
    assert released([65534, 65536, 65535, 65537]) == [[65534], [], [65535, 65536], [65537]]
    video = aiortc.rtcrtpreceiver.JitterBuffer(capacity=128, is_video=True)
    assert not video.on_arrival and video.pop_ready() is None


def test_apply_is_idempotent_and_restore_undoes_it(stock_aiortc: None) -> None:
    stock_sender = RTCRtpSender._next_encoded_frame
    aiortc_tuning.apply()
    aiortc_tuning.apply(audio_prefetch=3)
    assert aiortc_tuning.applied() and aiortc_tuning.audio_prefetch() == 3
    assert aiortc.rtp.compute_audio_level_dbov is aiortc_tuning.compute_audio_level_dbov
    buffer = aiortc.rtcrtpreceiver.JitterBuffer(capacity=16, prefetch=4)
    assert buffer._prefetch == 3
    video = aiortc.rtcrtpreceiver.JitterBuffer(capacity=512, is_video=True)
    assert video._prefetch == 0
    aiortc_tuning.restore()
    assert aiortc.rtp.compute_audio_level_dbov is aiortc_tuning.audio_level.STOCK
    assert aiortc.rtcrtpreceiver.JitterBuffer is aiortc_tuning.jitter.STOCK
    assert RTCRtpSender._next_encoded_frame is stock_sender
    assert aiortc_tuning.udp_drain.DatagramTransport._read_ready is aiortc_tuning.udp_drain.STOCK
    assert RTCRtpReceiver.__init__ is aiortc_tuning.loop_decode.STOCK_RECEIVER_INIT
    assert aiortc.rtcrtpreceiver.decoder_worker is aiortc_tuning.loop_decode.STOCK_DECODER_WORKER
    with pytest.raises(ValueError, match="audio_prefetch"):
        aiortc_tuning.apply(-1)
    with pytest.raises(ValueError, match="udp_reads_per_wake"):
        aiortc_tuning.apply(udp_reads_per_wake=0)


class _Decoder:
    """Decodes b"x" to "x@rate"; b"bad" fails."""

    def __init__(self, rate: int) -> None:
        self.rate = rate

    def decode(self, encoded: Any) -> list[str]:
        if encoded.data == b"bad":
            raise ValueError("corrupt")
        return [f"{encoded.data.decode()}@{self.rate}"]


@pytest.mark.parametrize("on_loop", [True, False])
async def test_audio_decodes_in_order_and_a_bad_frame_is_dropped_not_fatal(
    monkeypatch: pytest.MonkeyPatch, stock_aiortc: None, on_loop: bool
) -> None:
    """An audio receiver's frames reach its track decoded, in order, on the loop as they are
    put or from its thread; a frame that fails is logged and dropped and the next one decodes.
    Video keeps aiortc's queue for its thread."""
    monkeypatch.setattr(aiortc_tuning.loop_decode, "OpuslibDecoder", _Decoder)
    aiortc_tuning.apply(opus="opuslib", decode_on_loop=on_loop)
    assert aiortc_tuning.decode_on_loop() is on_loop
    transport = types.SimpleNamespace(state="new")
    receiver = RTCRtpReceiver("audio", transport)  # type: ignore[arg-type]
    video = RTCRtpReceiver("video", transport)  # type: ignore[arg-type]
    assert isinstance(video._RTCRtpReceiver__decoder_queue, queue.Queue)  # type: ignore[attr-defined]
    aiortc_tuning.decode_at(receiver, 16_000)
    track = receiver._track = RemoteStreamTrack(kind="audio")
    decoder_queue = receiver._RTCRtpReceiver__decoder_queue  # type: ignore[attr-defined]
    thread = threading.Thread(  # as RTCRtpReceiver.receive() starts it
        target=aiortc.rtcrtpreceiver.decoder_worker,
        args=(asyncio.get_running_loop(), decoder_queue, track._queue, None),
    )
    thread.start()
    if on_loop:
        thread.join(5)
        assert not thread.is_alive()  # nothing for it to do
    opus = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2)
    for data in (b"one", b"bad", b"two"):
        decoder_queue.put((opus, types.SimpleNamespace(data=data)))
    decoder_queue.put(None)
    got = [await asyncio.wait_for(track._queue.get(), 5) for _ in range(3)]
    await asyncio.to_thread(thread.join, 5)
    assert got == ["one@16000", "two@16000", None]
    assert receiver._RTCRtpReceiver__decoder_error.is_set()  # type: ignore[attr-defined]
    with pytest.raises(aiortc_tuning.AiortcTuningError, match="decode_at"):
        aiortc_tuning.decode_at(video, 16_000)


class _CountingStun(aioice.ice.StunProtocol):
    """aioice's protocol, as the drained read recognizes it, recording what it is handed."""

    def __init__(self) -> None:
        super().__init__(receiver=None)  # type: ignore[arg-type]
        self.received: list[bytes] = []

    def datagram_received(self, data: bytes | str, addr: tuple[Any, ...]) -> None:
        self.received.append(bytes(data))  # type: ignore[arg-type]


class _Counting(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.received.append(data)


async def _one_wake(protocol: asyncio.DatagramProtocol, queued: int) -> int:
    """Queue `queued` datagrams on a socket, wake its transport's reader once, count reads."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)  # queued at send
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: protocol, sock=ours)
    try:
        for i in range(queued):
            theirs.send(i.to_bytes(2, "big"))
        # No await between the sends and this call: the loop cannot read any of them first.
        transport._read_ready()  # type: ignore[attr-defined]
        got = protocol.received  # type: ignore[attr-defined]
        assert got == [i.to_bytes(2, "big") for i in range(len(got))]  # in order, none lost
        return len(got)
    finally:
        transport.close()
        theirs.close()


async def test_ice_sockets_read_what_is_queued_on_each_wake(stock_aiortc: None) -> None:
    assert await _one_wake(_CountingStun(), 40) == 1  # asyncio's own read
    aiortc_tuning.apply(udp_reads_per_wake=32)
    assert await _one_wake(_CountingStun(), 40) == 32
    assert await _one_wake(_CountingStun(), 5) == 5  # stops when the socket is drained
    assert await _one_wake(_Counting(), 40) == 1  # other protocols' sockets: as asyncio


def test_verify_passes_on_installed_aiortc() -> None:
    aiortc_tuning.verify()


@pytest.mark.parametrize(
    ("target", "name"),
    [
        (aiortc.rtp, "compute_audio_level_dbov"),
        (aiortc.rtcrtpreceiver, "JitterBuffer"),
        (RTCRtpSender, "_next_encoded_frame"),
        (RTCRtpSender, "kind"),
        (RTCRtpReceiver, "_handle_rtp_packet"),
        (aiortc.rtcrtpreceiver, "RemoteStreamTrack"),
        (aioice.ice, "StunProtocol"),
    ],
)
def test_verify_fails_when_a_patched_internal_is_missing(
    monkeypatch: pytest.MonkeyPatch, stock_aiortc: None, target: object, name: str
) -> None:
    # A context, so the attribute is back before stock_aiortc's teardown re-applies the tuning.
    with monkeypatch.context() as patch:
        patch.delattr(target, name)
        with pytest.raises(aiortc_tuning.AiortcTuningError, match=name):
            aiortc_tuning.verify()
        with pytest.raises(aiortc_tuning.AiortcTuningError):
            aiortc_tuning.apply()
        assert not aiortc_tuning.applied()


def test_verify_fails_when_the_sender_no_longer_uses_the_executor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def rewritten(self: RTCRtpSender, codec: object) -> None:
        return None

    monkeypatch.setattr(aiortc_tuning.inline_encode, "STOCK", rewritten)
    with pytest.raises(aiortc_tuning.AiortcTuningError, match="run_in_executor"):
        aiortc_tuning.verify()


def test_verify_fails_when_asyncio_reads_datagrams_another_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def rewritten(self: object) -> None:
        return None

    monkeypatch.setattr(aiortc_tuning.udp_drain, "STOCK", rewritten)
    with pytest.raises(aiortc_tuning.AiortcTuningError, match="recvfrom"):
        aiortc_tuning.verify()


# --- loopback echo: real aiortc peers, real Opus, over 127.0.0.1 only ---------------------------


class Echo(MediaStreamTrack):
    """Sends back what a remote track receives."""

    kind = "audio"

    def __init__(self, source: MediaStreamTrack) -> None:
        super().__init__()
        self._source = source
        self.shapes: set[tuple[int, str]] = set()  # (rate, layout) of what arrived
        self.decoder_threads = 0  # the most audio decoder threads seen alive while echoing

    async def recv(self) -> AudioFrame:
        frame = await self._source.recv()
        self.shapes.add((frame.sample_rate, frame.layout.name))  # type: ignore[union-attr]
        alive = sum(t.name == "audio-decoder" for t in threading.enumerate())
        self.decoder_threads = max(self.decoder_threads, alive)
        return frame  # type: ignore[return-value]


async def echo_round_trips_ms(
    bursts: int = 6, decode_rate: int | None = None, echoes: list[Echo] | None = None
) -> list[float]:
    """Round trips of tone bursts through an echoing peer; with `decode_rate`, the echoer's
    receiver decodes at that rate (aiortc_tuning.decode_at)."""
    caller = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    echoer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    source = ToneBursts()
    caller.addTrack(source)
    heard_at: list[float] = []
    heard_all = asyncio.Event()
    listeners: list[asyncio.Task[None]] = []

    async def listen(track: MediaStreamTrack) -> None:
        loud = False
        while len(heard_at) < bursts:
            frame = await track.recv()
            pcm = frame.to_ndarray().astype(np.float64)  # type: ignore[union-attr]
            now_loud = float(np.sqrt((pcm * pcm).mean())) > 1000
            if now_loud and not loud:
                heard_at.append(asyncio.get_running_loop().time())
            loud = now_loud
        heard_all.set()

    def echo(track: MediaStreamTrack) -> None:
        track_echo = Echo(track)
        if echoes is not None:
            echoes.append(track_echo)
        echoer.addTrack(track_echo)

    echoer.on("track", echo)
    caller.on(
        "track", lambda track: listeners.append(asyncio.create_task(listen(track), name="listen"))
    )
    try:
        await caller.setLocalDescription(await caller.createOffer())
        await echoer.setRemoteDescription(caller.localDescription)
        if decode_rate is not None:
            for transceiver in echoer.getTransceivers():
                aiortc_tuning.decode_at(transceiver.receiver, decode_rate)
        await echoer.setLocalDescription(await echoer.createAnswer())
        await caller.setRemoteDescription(echoer.localDescription)
        await asyncio.wait_for(heard_all.wait(), timeout=20)
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        await caller.close()
        await echoer.close()
    # Bursts are 400 ms apart and the echo is faster than that: pair each with the last one sent.
    return [(r - max(s for s in source.sent_at if s < r)) * 1000 for r in heard_at]


async def test_loopback_round_trip_drops_with_tuning(
    monkeypatch: pytest.MonkeyPatch, stock_aiortc: None
) -> None:
    # aioice leaves 127.0.0.1 out of its host candidates; offer loopback only, so the test
    # never leaves the machine.
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    # Which threads run the Opus encoder: the executor's when stock, the event loop's when tuned.
    encoder_threads: set[int] = set()
    stock_encode = OpusEncoder.encode

    def watched_encode(self: OpusEncoder, *args: Any, **kwargs: Any) -> Any:
        encoder_threads.add(threading.get_ident())
        return stock_encode(self, *args, **kwargs)

    monkeypatch.setattr(OpusEncoder, "encode", watched_encode)
    loop_thread = threading.get_ident()

    echoes: list[Echo] = []
    stock = statistics.median(await echo_round_trips_ms(echoes=echoes))
    assert encoder_threads and loop_thread not in encoder_threads
    assert echoes[0].decoder_threads == 2  # one per peer, decoding off the loop
    encoder_threads.clear()
    aiortc_tuning.apply(audio_prefetch=1, opus="aiortc")
    tuned = statistics.median(await echo_round_trips_ms(echoes=echoes))
    assert encoder_threads == {loop_thread}
    assert echoes[1].decoder_threads == 0  # decoded on the loop
    print(f"\nloopback echo round trip (median of 6): stock {stock:.0f} ms, tuned {tuned:.0f} ms")
    assert tuned < stock


async def test_a_lossy_uplink_is_heard_late_only_with_aiortcs_buffer(
    monkeypatch: pytest.MonkeyPatch, stock_aiortc: None
) -> None:
    """Real peers over 127.0.0.1, 5% of the packets dropped on the way (the same ones both
    times): aiortc's buffer keeps what queued behind each loss; the gateway's catches up."""
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    with variant("aiortc"):
        stock = await one_way_ms(bursts=12, loss=0.05, seed=7)
    with variant("gateway"):
        tuned = await one_way_ms(bursts=12, loss=0.05, seed=7)
    assert stock["packets_dropped"] and tuned["packets_dropped"]
    late, caught_up = (run["last_10_bursts_ms"]["p50"] for run in (stock, tuned))
    print(f"\none-way at 5% loss, last 10 bursts p50: aiortc {late:.0f}, ours {caught_up:.0f} ms")
    # 14 frames (280 ms) stay queued behind aiortc's first loss; the gateway waits 40 ms at most
    assert late - caught_up > 150, (stock, tuned)
    assert caught_up < 100, tuned


async def test_opuslib_decodes_at_the_pipeline_rate_and_keeps_the_round_trip(
    monkeypatch: pytest.MonkeyPatch, stock_aiortc: None
) -> None:
    """With opus="opuslib", a marked receiver gets 16 kHz mono straight from libopus (no
    resampler), the echo sends it back coded at 16 kHz, and the round trip is no slower."""
    monkeypatch.setattr(aioice.ice, "get_host_addresses", lambda use_ipv4, use_ipv6: ["127.0.0.1"])
    aiortc_tuning.apply(audio_prefetch=1, opus="aiortc")
    with_aiortc = statistics.median(await echo_round_trips_ms())
    aiortc_tuning.apply(audio_prefetch=1, opus="opuslib")
    assert aiortc_tuning.opus_codec() == "opuslib"
    echoes: list[Echo] = []
    with_libopus = statistics.median(await echo_round_trips_ms(decode_rate=16_000, echoes=echoes))
    assert echoes and echoes[0].shapes == {(16_000, "mono")}
    print(
        f"\nloopback echo round trip: aiortc Opus {with_aiortc:.0f} ms, "
        f"libopus {with_libopus:.0f} ms"
    )
    assert with_libopus < with_aiortc + 20


def test_the_pinned_versions_are_the_ones_the_patches_were_written_against() -> None:
    import importlib.metadata
    import tomllib
    from pathlib import Path

    from gateway.aiortc_tuning import common

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pins = dict(d.split("==") for d in project["project"]["dependencies"] if "==" in d)
    assert pins["aiortc"] == common.AIORTC_VERSION == importlib.metadata.version("aiortc")
    assert pins["aioice"] == common.AIOICE_VERSION == importlib.metadata.version("aioice")
