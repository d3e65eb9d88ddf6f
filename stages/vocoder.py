"""The vocoder stage: text deltas in, speech out, phrase by phrase while the reply grows.

Replies are interleaved a block at a time: each turn of the model loop takes the next chunk
(one streamed block of a neural voice) of the reply least far ahead of its playback, so one
caller's long phrase never holds up another caller's first audio. A cancel reaches the voice
itself: its `stop()` asks the session's epoch every decoder step, so the engine stops before the
CANCEL record is even read. `vocoder.replicas` runs several of these processes (stages.rings).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.backends.speech import Voice, split_pcm16
from stages.config import VocoderConfig
from stages.messages import AudioDone, Kind, Phrase
from stages.phrases import PhraseSplitter
from stages.rings import GATEWAY
from stages.worker import Inbound, QueuedStage

logger = logging.getLogger(__name__)


def load_voice(config: VocoderConfig) -> Voice:
    """The configured voice, loaded (the same code for tests and production)."""
    if config.backend == "espeak":
        from stages.backends.tts_espeak import load_espeak

        return load_espeak(voice=config.voice, **config.options)
    from stages.backends.tts_speecht5 import load_speecht5

    assert config.model and config.vocoder  # the config validator makes sure
    return load_speecht5(
        config.model,
        config.vocoder,
        speaker_embedding=config.speaker_embedding,
        device=config.device,
        **config.options,
    )


@dataclass
class Reply:
    response_id: str
    epoch: int
    splitter: PhraseSplitter
    # phrases waiting for the voice, with the stamp of the record that completed each
    pending: collections.deque[tuple[str, int]] = field(default_factory=collections.deque)
    speaking: Iterator[np.ndarray] | None = None  # the phrase being synthesized, chunk by chunk
    samples: int = 0  # synthesized so far
    started: float | None = None  # monotonic time of its first audio
    done_status: str | None = None  # set once the reply's text is complete
    paced: bool = True  # False: nobody plays it in real time (/v1/audio/speech)

    def lead_s(self, now: float, rate: int) -> float:
        """How far synthesis runs ahead of real-time playback of this reply."""
        if self.started is None or not self.paced:
            return 0.0
        return self.samples / rate - (now - self.started)

    @property
    def has_audio_to_make(self) -> bool:
        return self.speaking is not None or bool(self.pending)

    def stop_speaking(self) -> None:
        """Close the phrase's generator: the backend stops at its next block."""
        if self.speaking is not None:
            speaking, self.speaking = self.speaking, None
            close = getattr(speaking, "close", None)
            if close is not None:
                close()


class VocoderStage(QueuedStage):
    name = "vocoder"

    def load(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.voice = load_voice(self.config.vocoder)
        self.replies: dict[int, Reply] = {}
        logger.info(
            "vocoder: %s at %d Hz ready in %.1f s",
            self.voice.name,
            self.voice.sample_rate,
            time.monotonic() - t0,
        )
        return {"backend": self.voice.name, "sample_rate": self.voice.sample_rate}

    def handle(self, item: Inbound) -> None:
        s = item.session
        if item.kind is Kind.RESPONSE_STARTED:
            self._drop(s)
            if not item.msg.audio:
                return  # a text-only reply: nothing to say
            cfg = self.config.vocoder
            self.replies[s] = Reply(
                item.msg.response_id,
                item.epoch,
                PhraseSplitter(cfg.first_phrase_words, cfg.max_phrase_words),
                paced=item.msg.paced,
            )
        elif item.kind is Kind.TEXT_DELTA:
            reply = self._reply_for(item)
            if reply is not None:
                reply.pending.extend((p, item.t_ns) for p in reply.splitter.feed(item.msg.text))
        elif item.kind is Kind.RESPONSE_DONE:
            reply = self._reply_for(item)
            if reply is not None:
                if rest := reply.splitter.flush():
                    reply.pending.append((rest, item.t_ns))
                reply.done_status = item.msg.status
        elif item.kind is Kind.CANCEL:
            self._drop(s)
            self.ack(s, item.msg.cancel_id)
        elif item.kind in (Kind.SESSION_OPEN, Kind.SESSION_CLOSE):
            self._drop(s)

    def close(self) -> None:
        for session in list(getattr(self, "replies", ())):
            self._drop(session)
        super().close()

    def _drop(self, session: int) -> None:
        reply = self.replies.pop(session, None)
        if reply is not None:
            reply.stop_speaking()

    def pump(self) -> float | None:
        """Make the next chunk of the reply that is least far ahead of its playback.

        Synthesis stays at most `max_lead_ms` ahead of real time: a reply is not turned into a
        minute of audio in one burst, which would hold up every other session (and the
        gateway's event loop), only for most of it to be thrown away at a barge-in.
        """
        now, rate = time.monotonic(), self.voice.sample_rate
        max_lead = self.config.vocoder.max_lead_ms / 1000
        for session, reply in list(self.replies.items()):
            if not reply.has_audio_to_make and reply.done_status is not None:
                del self.replies[session]
                self.send(
                    GATEWAY,
                    session,
                    AudioDone(reply.response_id, reply.done_status),
                    epoch=reply.epoch,
                )
        ready = [
            (r.lead_s(now, rate), s, r) for s, r in self.replies.items() if r.has_audio_to_make
        ]
        if not ready:
            return None
        # ties (replies not started, or unpaced) go to the one with the least audio made
        lead, session, reply = min(ready, key=lambda t: (t[0], t[2].samples))
        if lead >= max_lead:
            return lead - max_lead
        try:
            self._speak_chunk(session, reply)
        except Exception as exc:  # this reply is lost; the other sessions' go on
            logger.exception("vocoder: speaking for session %d failed", session)
            self._drop(session)
            self.error(session, "synthesis_failed", f"{type(exc).__name__}: {exc}")
        return 0.0

    def _reply_for(self, item: Inbound) -> Reply | None:
        reply = self.replies.get(item.session)
        if reply is None or reply.response_id != item.msg.response_id:
            return None  # a reply we never saw start (its start was cancelled): ignore
        return reply

    def _speak_chunk(self, session: int, reply: Reply) -> None:
        """Synthesize the reply's next chunk (starting its next phrase if need be) and push it
        in pieces of at most 100 ms."""
        rate = self.voice.sample_rate
        if reply.speaking is None:
            text, ready_ns = reply.pending.popleft()
            phrase = Phrase(reply.response_id, text, rate, ready_ns)
            self.send(GATEWAY, session, phrase, epoch=reply.epoch)
            epoch = reply.epoch
            reply.speaking = iter(
                # a cancel stops the engine within a step, before the CANCEL record is read
                self.voice.synthesize(text, stop=lambda: self.control.epoch(session) != epoch)
            )
        try:
            chunk = next(reply.speaking)
        except StopIteration:
            reply.speaking = None
            return
        except BaseException:
            reply.stop_speaking()
            raise
        audio = self.outputs[self.spec.names.instance_for(GATEWAY, session)]
        for piece in split_pcm16(chunk, rate):
            if self.control.epoch(session) != reply.epoch:
                return  # cancelled meanwhile: the CANCEL in the inbox drops the reply
            audio.push(session, Kind.AUDIO_OUT, piece.tobytes(), epoch=reply.epoch)
            if reply.started is None:
                reply.started = time.monotonic()
            reply.samples += len(piece)
