"""The vocoder stage: text deltas in, speech out, phrase by phrase while the reply grows.

Replies are interleaved a block at a time: each turn of the model loop takes the next chunk
(one streamed block of a neural voice) of the reply least far ahead of its playback, so one
caller's long phrase never holds up another caller's first audio. A voice that batches
(SpeechT5) instead steps every reply that is not far enough ahead in one decoder pass, up to
`vocoder.batch` of them: on a GPU that costs about what one reply costs. A cancel reaches the
voice itself: its `stop()` asks the session's epoch every decoder step, so the engine stops
before the CANCEL record is even read. `vocoder.replicas` runs several of these processes
(stages.rings).

A reply started at the caller's pause (stages.prepared) is spoken while the caller's silence is
still being waited out, and what it makes is kept back: when the turn ends as it was,
reasoning's RESPONSE_RELEASE sends it all at once, from the reader thread rather than after the
decoder pass in progress.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from stages.backends import bundled
from stages.backends.speech import BlockVoice, PhraseStream, Voice, split_pcm16
from stages.config import RANDOM_SNAC, TINY_TALKER, VocoderConfig
from stages.envelope import Envelope
from stages.messages import (
    AudioDone,
    Cancel,
    Kind,
    Msg,
    Phrase,
    ResponseDone,
    ResponseRelease,
    ResponseStarted,
    TextDelta,
)
from stages.passlog import LatencyLog, PassLog
from stages.phrases import EarlyPhrase, PhraseSplitter
from stages.prepared import HeldBack
from stages.rings import GATEWAY
from stages.stage import QueuedStage
from stages.stops import Stop

logger = logging.getLogger(__name__)

SLOW_FIRST_AUDIO_S = 1.0  # a reply's first audio later than this is logged with where it went


def load_voice(config: VocoderConfig) -> Voice:
    """The configured voice, loaded (the same code for tests and production)."""
    if config.backend == "espeak":
        from stages.backends.tts_espeak import load_espeak

        return load_espeak(voice=config.voice, **config.options)
    assert config.model  # the config validator makes sure
    if config.backend == "talker":
        return _load_talker(config)
    model = bundled.resolve(config.model)
    if config.backend == "piper":
        from stages.backends.tts_piper import load_piper

        return load_piper(model, **config.options)
    from stages.backends.tts_speecht5 import load_speecht5

    assert config.vocoder  # the config validator makes sure
    return load_speecht5(
        model,
        bundled.resolve(config.vocoder),
        speaker_embedding=config.speaker_embedding,
        device=config.device,
        **config.options,
    )


def _load_talker(config: VocoderConfig) -> Voice:
    from stages.backends.tts_talker import load_talker

    assert config.model and config.vocoder  # the config validator makes sure
    model, codec = config.model, config.vocoder
    # the built-in ones are built here on first use; their folders carry the random-weights
    # marker, which the engine and the codec's loader log
    if model == TINY_TALKER:
        from stages.backends.tiny_talker import ensure_tiny_talker

        model = str(ensure_tiny_talker())
    if codec == RANDOM_SNAC:
        from stages.backends.tiny_talker import ensure_snac

        codec = str(ensure_snac())
    return load_talker(model, codec, device=config.device, **config.options)


@dataclass
class SpokenReply:
    response_id: str
    epoch: int
    splitter: PhraseSplitter
    # phrases waiting for the voice, with the stamp of the record that completed each
    pending: collections.deque[tuple[str, int]] = field(default_factory=collections.deque)
    # the phrase being synthesized: chunk by chunk, or a block per `advance` of a batching voice
    speaking: Iterator[np.ndarray] | PhraseStream | None = None
    samples: int = 0  # synthesized so far
    started: float | None = None  # monotonic time of its first audio
    done_status: str | None = None  # set once the reply's text is complete
    paced: bool = True  # False: nobody plays it in real time (/v1/audio/speech)
    # a reply made at the caller's pause: its records for the gateway (a message, or a piece
    # of audio), kept back until RESPONSE_RELEASE (None: one made as the turn ended)
    held: HeldBack[Msg | bytes] | None = None
    first_phrase_ns: int = 0  # stamp of the record that completed its first phrase
    first_spoken_ns: int = 0  # when its first phrase went to the voice

    @property
    def at_pause(self) -> bool:
        return self.held is not None

    @property
    def holding(self) -> bool:
        """Made at the caller's pause and not released yet."""
        return self.held is not None and self.held.holding

    def lead_s(self, now: float, rate: int) -> float:
        """How far synthesis runs ahead of real-time playback of this reply."""
        if self.holding:
            return self.samples / rate  # none of it is playing yet
        if self.started is None or not self.paced:
            return 0.0
        return self.samples / rate - (now - self.started)

    @property
    def has_audio_to_make(self) -> bool:
        return self.speaking is not None or bool(self.pending)

    def stop_speaking(self) -> None:
        """Close the phrase's generator or stream: the backend stops at its next block."""
        if self.speaking is not None:
            speaking, self.speaking = self.speaking, None
            close = getattr(speaking, "close", None)
            if close is not None:
                close()


class BatchingVoice(Voice, BlockVoice, Protocol):
    """A voice that steps several phrases in one pass (stages.backends.tts_speecht5 and
    tts_talker)."""


class VocoderStage(QueuedStage):
    name = "vocoder"

    def load(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.voice = load_voice(self.config.vocoder)
        self.replies: dict[int, SpokenReply] = {}
        self.early = EarlyPhrase(self.config.vocoder.early_phrase_ms / 1000)
        self.batching: BatchingVoice | None = (
            self.voice if hasattr(self.voice, "advance") else None  # type: ignore[assignment]
        )
        self.passes = PassLog("vocoder", "replies")
        # from a reply's first phrase complete to its first audio made: the vocoder's part of a
        # turn, which a reply made at the caller's pause must finish before the turn ends
        self.first_audio = {
            at_pause: LatencyLog(f"vocoder: first audio after the first phrase, {what}")
            for at_pause, what in ((True, "replies made at the pause"), (False, "other replies"))
        }
        logger.info(
            "vocoder: %s at %d Hz ready in %.1f s",
            self.voice.name,
            self.voice.sample_rate,
            time.monotonic() - t0,
        )
        return {"backend": self.voice.name, "sample_rate": self.voice.sample_rate}

    def deliver(self, env: Envelope) -> None:
        msg = env.msg
        if isinstance(msg, Cancel):
            # Acknowledged from here, the reader thread, not after the decoder pass in progress
            # (tens of ms with a batch of replies): the session's epoch was bumped before the
            # CANCEL was sent, every decoder step and every push of this stage checks it, and the
            # gateway's ring drops a piece pushed in between, so from here on nothing of the
            # cancelled reply leaves the stage; the model loop drops its state next. A talker
            # voice aborts the session's request first, and the ack carries its KV usage once
            # the engine has applied the abort, sent from the engine's loop while this reader
            # goes on to the records behind the CANCEL.
            self._ack_after_abort(env.session, msg)
        elif isinstance(msg, ResponseRelease) and msg.keep and not self.is_stale(env):
            # Sent here too, on the reader thread: the model loop reads it only after the
            # decoder pass in progress (tens of ms at 8 callers), and the caller's first audio
            # would wait for it. A reply whose start the loop has not handled yet is released
            # there; a release is done once.
            reply = self._reply_for(env.session, msg.response_id)
            if reply is not None:
                self._release(env.session, reply)
        super().deliver(env)

    def handle(self, env: Envelope) -> None:
        s, msg = env.session, env.msg
        match msg:
            case ResponseStarted():
                self._drop(s)
                if not msg.audio:
                    return  # a text-only reply: nothing to say
                cfg = self.config.vocoder
                self.replies[s] = SpokenReply(
                    msg.response_id,
                    env.epoch,
                    PhraseSplitter(cfg.first_phrase_words, cfg.max_phrase_words),
                    paced=msg.paced,
                    held=HeldBack() if msg.held else None,
                )
            case TextDelta():
                if (reply := self._reply_for(s, msg.response_id)) is not None:
                    reply.pending.extend((p, env.t_ns) for p in reply.splitter.feed(msg.text))
            case ResponseDone():
                if (reply := self._reply_for(s, msg.response_id)) is not None:
                    if rest := reply.splitter.flush():
                        reply.pending.append((rest, env.t_ns))
                    reply.done_status = msg.status
            case ResponseRelease():  # keep (a drop is a stop)
                if (reply := self._reply_for(s, msg.response_id)) is not None:
                    self._release(s, reply)

    def on_stop(self, session: int, stop: Stop) -> None:
        """A stop that ends the session's reply drops it (a CANCEL was acknowledged already,
        by `deliver`)."""
        reply = self.replies.get(session)
        if reply is not None and stop.ends_reply(reply.response_id, reply.epoch):
            self._drop(session)

    def _ack_after_abort(self, session: int, cancel: Cancel) -> None:
        abort = getattr(self.voice, "abort_stopped", None)
        if abort is None:
            self.ack(session, cancel)
        else:
            abort(lambda kv: self.ack(session, cancel, kv_usage=kv))

    def close(self) -> None:
        for session in list(getattr(self, "replies", ())):
            self._drop(session)
        close = getattr(getattr(self, "voice", None), "close", None)
        if close is not None:  # a voice with processes of its own (the talker's engine)
            close()
        super().close()

    def _release(self, session: int, reply: SpokenReply) -> None:
        """Send what a held reply made, in order; from now on it is paced as it plays.
        Called on a reader thread or the model loop (HeldBack keeps the order)."""

        def send(records: list[Msg | bytes]) -> None:
            if reply.samples:
                reply.started = time.monotonic()
            for record in records:
                if not self._send_now(session, reply, record):
                    return  # cancelled meanwhile: the CANCEL in the inbox drops the reply

        if reply.held is not None:
            reply.held.release(send)

    def _to_gateway(self, session: int, reply: SpokenReply, record: Msg | bytes) -> bool:
        """Send (or keep back, while the reply is held) a message or a piece of PCM16 audio;
        False once the session's epoch has moved past the reply."""
        if reply.held is not None and reply.held.keep(record):
            return True
        return self._send_now(session, reply, record)

    def _send_now(self, session: int, reply: SpokenReply, record: Msg | bytes) -> bool:
        if self.control.epoch(session) != reply.epoch:
            return False
        if isinstance(record, bytes):
            self.push_audio(session, record, reply.epoch)
        else:
            self.send(GATEWAY, session, record, epoch=reply.epoch)
        return True

    def push_audio(self, session: int, pcm16: bytes, epoch: int) -> None:
        """One piece of audio onto the session's gateway ring."""
        self.ends.outbox(GATEWAY, session).push(session, Kind.AUDIO_OUT, pcm16, epoch=epoch)

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
        if getattr(self.voice, "dead", False):
            # the talker's engine is gone: a non-zero exit, and the supervisor restarts the stage
            self.cannot_serve(f"the voice {self.voice.name} died")
            raise RuntimeError(f"vocoder: the voice {self.voice.name} died")
        now, rate = time.monotonic(), self.voice.sample_rate
        max_lead = self.config.vocoder.max_lead_ms / 1000
        for session, reply in list(self.replies.items()):
            if not reply.holding and not reply.has_audio_to_make and reply.done_status is not None:
                del self.replies[session]
                self._to_gateway(session, reply, AudioDone(reply.response_id, reply.done_status))
        wake = self._speak_early(now, rate)
        ready: list[tuple[float, int, SpokenReply]] = []
        for session, reply in self.replies.items():
            lead = reply.lead_s(now, rate)
            # a held reply waits for its release once it has made as much as may be ahead
            if reply.has_audio_to_make and not (reply.holding and lead >= max_lead):
                ready.append((lead, session, reply))
        if not ready:
            return wake
        # ties (replies not started, or unpaced) go to the one with the least audio made
        ready.sort(key=lambda t: (t[0], t[2].samples))
        lead = ready[0][0]
        if lead >= max_lead:
            return min(lead - max_lead, wake if wake is not None else max_lead)
        if self.batching is not None:
            group = [(s, r) for lead, s, r in ready if lead < max_lead]
            self._speak_together(group[: self.config.vocoder.batch])
            return 0.0
        _, session, reply = ready[0]
        try:
            self._speak_chunk(session, reply)
        except Exception as exc:  # this reply is lost; the other sessions' go on
            self._failed([session], exc)
        return 0.0

    def _speak_early(self, now: float, rate: int) -> float | None:
        """Give the voice the words written so far of each playing reply about to fall silent
        while its clause goes on (EarlyPhrase); how long until the next one may be."""
        wake: float | None = None
        for reply in self.replies.values():
            playing = reply.started is not None and reply.paced and not reply.holding
            if not playing or reply.has_audio_to_make or reply.done_status is not None:
                continue
            wait = self.early.wait_s(reply.lead_s(now, rate))
            if wait is None:
                continue
            if wait == 0:
                phrase = reply.splitter.take_words(self.early.min_words)
                if phrase is not None:
                    reply.pending.append((phrase, time.monotonic_ns()))
                continue  # too few words yet: the next text delta wakes the loop
            wake = wait if wake is None else min(wake, wait)
        return wake

    def _failed(self, sessions: list[int], exc: Exception) -> None:
        logger.exception("vocoder: speaking for session(s) %s failed", sessions)
        for session in sessions:
            self._drop(session)
            self.error(session, "synthesis_failed", f"{type(exc).__name__}: {exc}")

    def _reply_for(self, session: int, response_id: str) -> SpokenReply | None:
        reply = self.replies.get(session)
        if reply is None or reply.response_id != response_id:
            return None  # a reply we never saw start (its start was cancelled): ignore
        return reply

    def _next_phrase(self, session: int, reply: SpokenReply) -> tuple[str, Callable[[], bool]]:
        """Announce the reply's next phrase to the gateway; its text, and its `stop` test."""
        text, ready_ns = reply.pending.popleft()
        reply.first_phrase_ns = reply.first_phrase_ns or ready_ns
        reply.first_spoken_ns = reply.first_spoken_ns or time.monotonic_ns()
        phrase = Phrase(reply.response_id, text, self.voice.sample_rate, ready_ns)
        self._to_gateway(session, reply, phrase)
        epoch = reply.epoch
        # a cancel stops the engine within a step, before the CANCEL record is read
        return text, lambda: self.control.epoch(session) != epoch

    def _speak_chunk(self, session: int, reply: SpokenReply) -> None:
        """Synthesize the reply's next chunk (starting its next phrase if need be) and push it
        in pieces of at most 100 ms."""
        if reply.speaking is None:
            text, stop = self._next_phrase(session, reply)
            reply.speaking = iter(self.voice.synthesize(text, stop=stop))
        try:
            chunk = next(reply.speaking)  # type: ignore[arg-type]
        except StopIteration:
            reply.speaking = None
            return
        except BaseException:
            reply.stop_speaking()
            raise
        self._push(session, reply, chunk)

    def _speak_together(self, group: list[tuple[int, SpokenReply]]) -> None:
        """The next block of every reply in ``group``, their decoder steps in one pass."""
        assert self.batching is not None
        streams = []
        for session, reply in group:
            if reply.speaking is None:
                text, stop = self._next_phrase(session, reply)
                reply.speaking = self.batching.begin(text, stop)
            streams.append(reply.speaking)  # type: ignore[arg-type]
        started = time.monotonic()
        try:
            blocks = self.batching.advance(streams)
        except Exception as exc:  # these replies are lost; the other sessions' go on
            self._failed([session for session, _ in group], exc)
            return
        self.passes.add(len(group), time.monotonic() - started)
        for (session, reply), stream, block in zip(group, streams, blocks, strict=True):
            if stream.done:
                reply.speaking = None
            self._push(session, reply, block)

    def _push(self, session: int, reply: SpokenReply, chunk: np.ndarray) -> None:
        """Push ``chunk`` of the reply's audio to the gateway in pieces of at most 100 ms."""
        if not reply.samples and len(chunk):
            made_s = (time.monotonic_ns() - reply.first_phrase_ns) / 1e9
            self.first_audio[reply.at_pause].add(made_s)
            if made_s > SLOW_FIRST_AUDIO_S:  # where the time went: before the voice, or in it
                logger.info(
                    "vocoder: reply %s: first audio %.0f ms after its first phrase, given to "
                    "the voice after %.0f ms",
                    reply.response_id,
                    made_s * 1000,
                    (reply.first_spoken_ns - reply.first_phrase_ns) / 1e6,
                )
        for piece in split_pcm16(chunk, self.voice.sample_rate):
            if not self._to_gateway(session, reply, piece.tobytes()):
                return  # cancelled meanwhile: the CANCEL in the inbox drops the reply
            if reply.started is None and not reply.holding:
                reply.started = time.monotonic()
            reply.samples += len(piece)
