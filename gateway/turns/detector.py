"""One caller's turns from a speech classifier's per-frame decisions, with OpenAI's
`server_vad` knobs (gateway.turns.classifiers has the classifiers).

The session feeds every 20 ms frame of the caller's 16 kHz PCM16 and gets `VadStart` /
`VadStop` back, stamped in ms of audio fed since the session began (the clock OpenAI's
`input_audio_buffer.speech_started/stopped` events use). A start carries the audio from
`prefix_padding_ms` before the speech up to now, so the encoder hears the whole first syllable.

Knobs:
- `threshold` (0..1, OpenAI default 0.5): the classifier's (gateway.turns.classifiers).
- `prefix_padding_ms` (default 300): audio before the detected start that goes with the start.
- `silence_duration_ms` (default 500): unvoiced time after the last speech that ends the turn.
- `onset_ms` (default 60): voiced time in a row that it takes to start a turn (or, inside a turn,
  to count as speech again), so a click or a breath does not start one or keep one open.

webrtcvad alone is not enough for that hysteresis: its built-in hangover marks 3-5 frames after
any burst as voiced (a 5 ms click gives 80 ms of "speech"), and its noise model calls a sudden
noise floor speech. So a frame also has to be louder than `min_level_dbfs` and `noise_margin_db`
above a tracked noise floor (follows quieter frames at once, louder ones at 2 dB/s) to count.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np

from gateway.turns.classifiers import SpeechClassifier, WebrtcClassifier
from stages.messages import FRAME_MS, FRAME_SAMPLES

__all__ = ["TurnDetector", "VadEvent", "VadPause", "VadResume", "VadStart", "VadStop"]

# webrtcvad's noise model starts empty and calls the first ~6 frames of any noise speech (seen
# here for noise from -70 to -30 dBFS in every mode); they train it but never count as voiced.
WARMUP_FRAMES = 6
_FLOOR_RISE_DB = 2.0 * FRAME_MS / 1000  # per frame: slow enough that a long phrase stays above it
_SILENT_DBFS = -100.0  # the level of digital silence, instead of -inf


@dataclass(frozen=True, slots=True, eq=False)
class VadStart:
    """A turn began.

    `audio_start_ms` is where the audio handed to the encoder begins: the speech onset minus the
    prefix padding (OpenAI's meaning of the field). `speech_start_ms` is the first voiced frame.
    `prefix` holds the samples from `audio_start_ms` to the end of the frame that confirmed the
    start; the frames after it follow as they are fed.
    """

    audio_start_ms: int
    speech_start_ms: int
    prefix: np.ndarray = field(repr=False)


@dataclass(frozen=True, slots=True)
class VadStop:
    """A turn ended.

    `audio_end_ms` is when the silence lasted `silence_duration_ms`, i.e. the end of the audio the
    encoder got for the turn (OpenAI's meaning); `speech_end_ms` is the end of the last speech.
    """

    audio_end_ms: int
    speech_end_ms: int


@dataclass(frozen=True, slots=True)
class VadPause:
    """The caller has been quiet for `pause_ms` inside a turn: the turn may be over. The reply
    can be prepared now, and is either wanted (VadStop follows) or not (VadResume)."""

    speech_end_ms: int
    silence_to_come_ms: int = 0  # until the silence window ends the turn, if nothing is said


@dataclass(frozen=True, slots=True)
class VadResume:
    """Speech again after a VadPause, before the turn ended: the same turn goes on."""

    speech_ms: int  # end of the voiced run that counted as speech again


VadEvent = VadStart | VadStop | VadPause | VadResume


class TurnDetector:
    """One caller's turns from a classifier's per-frame decisions (webrtcvad unless
    `classifier` says otherwise), with onset/offset hysteresis."""

    def __init__(
        self,
        threshold: float = 0.5,
        prefix_padding_ms: int = 300,
        silence_duration_ms: int = 500,
        onset_ms: int = 60,
        min_level_dbfs: float = -60.0,
        noise_margin_db: float = 10.0,
        pause_ms: int = 0,
        classifier: SpeechClassifier | None = None,
    ) -> None:
        """`pause_ms`: silence inside a turn after which VadPause is reported (0: never;
        only a value under `silence_duration_ms` ever fires)."""
        self._classifier = classifier or WebrtcClassifier(threshold)
        self._frames_fed = 0
        self._noise_floor_dbfs: float | None = None
        self._ring: collections.deque[np.ndarray] = collections.deque()
        self.min_level_dbfs = min_level_dbfs
        self.noise_margin_db = noise_margin_db
        if pause_ms < 0:
            raise ValueError(f"pause_ms must be >= 0, got {pause_ms}")
        self.pause_ms = pause_ms
        self.update(
            threshold=threshold,
            prefix_padding_ms=prefix_padding_ms,
            silence_duration_ms=silence_duration_ms,
            onset_ms=onset_ms,
        )
        self.reset()

    def update(
        self,
        threshold: float | None = None,
        prefix_padding_ms: int | None = None,
        silence_duration_ms: int | None = None,
        onset_ms: int | None = None,
    ) -> None:
        """Change knobs mid-session (`session.update`); None keeps a knob. Durations are rounded
        up to whole 20 ms frames."""
        if threshold is not None:
            self._classifier.set_threshold(threshold)
            self.threshold = threshold
        for name, value in (
            ("prefix_padding_ms", prefix_padding_ms),
            ("silence_duration_ms", silence_duration_ms),
            ("onset_ms", onset_ms),
        ):
            if value is None:
                continue
            if value < 0 or (name == "onset_ms" and value == 0):
                raise ValueError(f"{name} must be {'> 0' if name == 'onset_ms' else '>= 0'}")
            setattr(self, name, int(value))
        self._onset_frames = max(1, -(-self.onset_ms // FRAME_MS))
        self._prefix_frames = -(-self.prefix_padding_ms // FRAME_MS)
        # The ring covers the padding plus the voiced run that confirms a start.
        self._ring = collections.deque(self._ring, maxlen=self._prefix_frames + self._onset_frames)

    def reset(self) -> None:
        """Forget any turn in progress and the prefix audio (`input_audio_buffer.clear`); the
        clock keeps running."""
        self._ring.clear()
        self._voiced_run = 0
        self._in_speech = False
        self._paused = False
        self._speech_end_ms = 0
        self._pause_limit_ms: int | None = None

    @property
    def in_speech(self) -> bool:
        """True between a VadStart and its VadStop."""
        return self._in_speech

    @property
    def speech_end_ms(self) -> int:
        """The end of the caller's last speech: it names the pause that follows."""
        return self._speech_end_ms

    @property
    def silence_ms(self) -> int:
        """Inside a turn, how long the caller has been quiet (0 while they speak)."""
        return self.audio_ms - self._speech_end_ms if self._in_speech else 0

    def limit_pause(self, silence_ms: int) -> None:
        """End the turn once this pause has lasted `silence_ms`, instead of
        `silence_duration_ms` (the end-of-turn model's say); speech again undoes it."""
        self._pause_limit_ms = silence_ms

    def end_turn(self) -> VadStop | None:
        """End the turn in progress now (None if there is none)."""
        if not self._in_speech:
            return None
        self._in_speech = False
        self._paused = False
        self._voiced_run = 0
        self._pause_limit_ms = None
        return VadStop(self.audio_ms, self._speech_end_ms)

    @property
    def audio_ms(self) -> int:
        """Milliseconds of audio fed so far: the session's audio clock."""
        return self._frames_fed * FRAME_MS

    @property
    def voiced_run(self) -> int:
        """Voiced frames in a row up to the last one fed (a turn starts at the onset's)."""
        return self._voiced_run

    @property
    def noise_floor_dbfs(self) -> float | None:
        """The tracked background level, None before the first frame."""
        return self._noise_floor_dbfs

    def _loud_enough(self, frame: np.ndarray) -> bool:
        """Update the noise floor with this frame; is the frame clearly above it?"""
        samples = frame.astype(np.int64)
        energy = int((samples * samples).sum())
        level = 10 * math.log10(energy / (FRAME_SAMPLES * 32768.0**2)) if energy else _SILENT_DBFS
        floor = self._noise_floor_dbfs
        floor = level if floor is None else min(level, floor + _FLOOR_RISE_DB)
        self._noise_floor_dbfs = floor = max(floor, _SILENT_DBFS)
        return level >= self.min_level_dbfs and level >= floor + self.noise_margin_db

    def feed(self, frame20ms: np.ndarray) -> list[VadEvent]:
        """Classify one 20 ms frame (320 int16 samples) and return the events it causes."""
        frame = np.asarray(frame20ms)
        if frame.dtype != np.int16 or frame.size != FRAME_SAMPLES:
            raise ValueError(
                f"a frame is {FRAME_SAMPLES} int16 samples (20 ms at 16 kHz), "
                f"got {frame.size} {frame.dtype}"
            )
        frame = np.array(frame, dtype=np.int16, copy=True).reshape(-1)
        # Both see every frame: each keeps its own model of the background current.
        loud = self._loud_enough(frame)
        voiced = self._classifier.is_speech(frame) and loud
        self._frames_fed += 1
        voiced = voiced and self._frames_fed > WARMUP_FRAMES
        frame_end_ms = self._frames_fed * FRAME_MS
        self._voiced_run = self._voiced_run + 1 if voiced else 0

        if not self._in_speech:
            self._ring.append(frame)
            if self._voiced_run < self._onset_frames:
                return []
            self._in_speech = True
            self._speech_end_ms = frame_end_ms
            speech_start_ms = frame_end_ms - self._voiced_run * FRAME_MS
            held = list(self._ring)
            audio_start_ms = frame_end_ms - len(held) * FRAME_MS
            self._ring.clear()
            return [VadStart(audio_start_ms, speech_start_ms, np.concatenate(held))]

        if self._voiced_run >= self._onset_frames:
            self._speech_end_ms = frame_end_ms
            self._pause_limit_ms = None
            if self._paused:
                self._paused = False
                return [VadResume(frame_end_ms)]
        elif frame_end_ms - self._speech_end_ms >= (
            self.silence_duration_ms if self._pause_limit_ms is None else self._pause_limit_ms
        ):
            stopped = self.end_turn()
            assert stopped is not None
            return [stopped]
        elif (
            self.pause_ms
            and not self._paused
            and frame_end_ms - self._speech_end_ms >= self.pause_ms
        ):
            self._paused = True
            quiet_ms = frame_end_ms - self._speech_end_ms
            return [VadPause(self._speech_end_ms, max(0, self.silence_duration_ms - quiet_ms))]
        return []
