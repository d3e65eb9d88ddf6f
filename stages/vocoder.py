"""The vocoder stage: text deltas in, speech out, phrase by phrase while the reply grows."""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

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
    pending: collections.deque[str] = field(default_factory=collections.deque)
    spoken: list[str] = field(default_factory=list)
    samples: int = 0  # synthesized so far
    started: float | None = None  # monotonic time of its first audio
    done_status: str | None = None  # set once the reply's text is complete
    paced: bool = True  # False: nobody plays it in real time (/v1/audio/speech)

    def lead_s(self, now: float, rate: int) -> float:
        """How far synthesis runs ahead of real-time playback of this reply."""
        if self.started is None or not self.paced:
            return 0.0
        return self.samples / rate - (now - self.started)


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
            self.replies.pop(s, None)
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
                reply.pending.extend(reply.splitter.feed(item.msg.text))
        elif item.kind is Kind.RESPONSE_DONE:
            reply = self._reply_for(item)
            if reply is not None:
                if rest := reply.splitter.flush():
                    reply.pending.append(rest)
                reply.done_status = item.msg.status
        elif item.kind is Kind.CANCEL:
            self.replies.pop(s, None)
            self.ack(s, item.msg.cancel_id)
        elif item.kind in (Kind.SESSION_OPEN, Kind.SESSION_CLOSE):
            self.replies.pop(s, None)

    def pump(self) -> float | None:
        """Speak the next phrase of the reply that is least far ahead of its playback.

        Synthesis stays at most `max_lead_ms` ahead of real time: a reply is not turned into a
        minute of audio in one burst, which would hold up every other session (and the
        gateway's event loop), only for most of it to be thrown away at a barge-in.
        """
        now, rate = time.monotonic(), self.voice.sample_rate
        max_lead = self.config.vocoder.max_lead_ms / 1000
        for session, reply in list(self.replies.items()):
            if not reply.pending and reply.done_status is not None:
                del self.replies[session]
                self.send(
                    GATEWAY,
                    session,
                    AudioDone(reply.response_id, reply.done_status),
                    epoch=reply.epoch,
                )
        ready = [(r.lead_s(now, rate), s, r) for s, r in self.replies.items() if r.pending]
        if not ready:
            return None
        lead, session, reply = min(ready, key=lambda t: t[0])
        if lead >= max_lead:
            return lead - max_lead
        self._speak(session, reply, reply.pending.popleft())
        return 0.0

    def _reply_for(self, item: Inbound) -> Reply | None:
        reply = self.replies.get(item.session)
        if reply is None or reply.response_id != item.msg.response_id:
            return None  # a reply we never saw start (its start was cancelled): ignore
        return reply

    def _speak(self, session: int, reply: Reply, text: str) -> None:
        """Synthesize one phrase and stream it in chunks of at most 100 ms, stopping between
        chunks if the session is cancelled meanwhile."""
        rate = self.voice.sample_rate
        self.send(GATEWAY, session, Phrase(reply.response_id, text, rate), epoch=reply.epoch)
        audio = self.outputs[GATEWAY]
        chunks = self.voice.synthesize(text)
        try:
            for chunk in chunks:
                for piece in split_pcm16(chunk, rate):
                    if self.control.epoch(session) != reply.epoch:
                        return  # cancelled mid-phrase: the CANCEL in the inbox acks it
                    audio.push(session, Kind.AUDIO_OUT, piece.tobytes(), epoch=reply.epoch)
                    if reply.started is None:
                        reply.started = time.monotonic()
                    reply.samples += len(piece)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        reply.spoken.append(text)
