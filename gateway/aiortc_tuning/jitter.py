"""The audio jitter buffer: a configurable prefetch, frames handed on as they arrive, and a
bounded wait for a lost packet.

The buffer that `RTCRtpReceiver` builds holds `prefetch=4` frames (about 80 ms per receiving
hop) before it releases one, and even at 0 one frame (20 ms); and one lost packet leaves the
frames queued behind it queued for the rest of the call (~280 ms). Retire this once aiortc's
receiver takes a prefetch for audio and gives up on a lost packet after a bounded wait.
"""

from __future__ import annotations

import inspect
from typing import Any

import aiortc.rtcrtpreceiver as _rtcrtpreceiver
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.utils import uint16_add as _uint16_add

from gateway.aiortc_tuning.common import code_names, fail, settings

STOCK: type[JitterBuffer] = _rtcrtpreceiver.JitterBuffer


class PrefetchJitterBuffer(STOCK):
    """aiortc's JitterBuffer with the audio prefetch taken from `apply(audio_prefetch=...)`, and
    a bounded wait for a lost audio packet.

    Installed only as the name `JitterBuffer` inside aiortc.rtcrtpreceiver, the one place that
    builds receive buffers; video buffers pass through unchanged. Stock, a frame is released
    when the first packet of the next frame arrives (a video frame spans packets), so even
    prefetch 0 holds 20 ms. An audio packet is a whole frame (RFC 7587: one Opus packet per
    RTP packet): with prefetch 0, each is released as it arrives, in order (`pop_ready` hands
    out the ones a late packet held back).

    Stock, a missing packet blocks every frame behind it until the buffer is full (16 packets
    for audio), and as it releases one frame per packet added, the frames queued meanwhile stay
    queued: one lost packet adds ~280 ms to the rest of the call. Here an audio buffer waits
    `LATE_PACKETS` packets for a missing one, then gives up on it (with prefetch 1 or more,
    dropping the oldest frames until it is back at its prefetch); a packet that comes after
    that is ignored as too late.
    """

    LATE_PACKETS = 2  # 40 ms of 20 ms packets: reordering on a path, not a loss

    def __init__(self, capacity: int, prefetch: int = 0, is_video: bool = False) -> None:
        if not is_video:
            prefetch = settings.audio_prefetch
        super().__init__(capacity, prefetch=prefetch, is_video=is_video)
        self.on_arrival = not is_video and prefetch == 0

    def pop_ready(self) -> JitterFrame | None:
        """With prefetch 0, the next audio frame in order if it is here, else None."""
        if not self.on_arrival or self._origin is None:
            return None
        packet = self._packets[self._origin % self._capacity]
        if packet is None:
            return None
        self.remove(1)
        return JitterFrame(data=packet._data, timestamp=packet.timestamp)

    def _add_on_arrival(self, packet: Any) -> JitterFrame | None:
        if self._origin is None:
            self._origin = packet.sequence_number
        ahead = _uint16_add(packet.sequence_number, -self._origin)
        if ahead >= 0x8000:
            return None  # older than a frame already released: too late, or a duplicate
        if ahead >= self._capacity:  # far ahead of the rest: start again from this packet
            self.remove(self._capacity)
            self._origin, ahead = packet.sequence_number, 0
        self._packets[packet.sequence_number % self._capacity] = packet
        if ahead > self.LATE_PACKETS:  # give up on the holes before the oldest packet here
            skip = next(
                k
                for k in range(ahead + 1)
                if self._packets[(self._origin + k) % self._capacity] is not None
            )
            self.remove(skip)
        return self.pop_ready()

    def add(self, packet: Any) -> tuple[bool, Any]:
        if self.on_arrival:
            return False, self._add_on_arrival(packet)
        pli_flag, frame = super().add(packet)
        if self._is_video or self._origin is None:
            return pli_flag, frame
        keep = max(self._prefetch, 1)  # packets held normally: the next frame's first
        span = _uint16_add(packet.sequence_number, -self._origin) + 1
        if span > keep + self.LATE_PACKETS:
            # whole frames, oldest first, holes included (emptied: start again here, as stock)
            if self.smart_remove(span - keep):
                self._origin = packet.sequence_number
            if frame is None:
                frame = self._remove_frame(packet.sequence_number)
        return pli_flag, frame


def verify() -> None:
    """The receiver's jitter buffer is built from the name JitterBuffer in its module."""
    jitter_buffer = getattr(_rtcrtpreceiver, "JitterBuffer", None)
    if not (isinstance(jitter_buffer, type) and issubclass(jitter_buffer, STOCK)):
        raise fail("aiortc.rtcrtpreceiver.JitterBuffer is missing")
    params = list(inspect.signature(STOCK.__init__).parameters)
    if params[:4] != ["self", "capacity", "prefetch", "is_video"]:
        raise fail(f"JitterBuffer.__init__ takes {params[1:]}, not (capacity, prefetch, is_video)")
    if "JitterBuffer" not in code_names(RTCRtpReceiver.__init__):
        raise fail("RTCRtpReceiver.__init__ no longer builds a JitterBuffer")


def install() -> None:
    _rtcrtpreceiver.JitterBuffer = PrefetchJitterBuffer  # type: ignore[misc]


def remove() -> None:
    _rtcrtpreceiver.JitterBuffer = STOCK  # type: ignore[misc]
