"""What the caller's voice over the agent does (gateway.turns.interruptions): the decisions, for
the session to carry out through gateway.session.stop and the transport's hold.

Under `immediate`, speech over the agent cuts the reply at its onset. Under `provisional`, a
turn begun while a reply plays pauses it, and is an interruption only once it proves to be.
A cough, a noise or an "mm-hmm" is not one: the agent's audio is held where it stopped (the
transport's hold, nothing dropped) while the stages go on making the reply, and the turn's
transcript decides when it comes, the gateway's alone (SPEECH_STOPPED provisional: reasoning
is not sent it, so nothing of it enters the conversation unless it counts):

- no words, or only backchannels and hums: the turn is dropped and the agent resumes;
- words that count: the reply is cut where it paused (one cancel, as a barge-in) and the
  caller's words are answered;
- speech that goes on for `confirm_ms`: an interruption without waiting for its words; the
  turn is begun again as an ordinary one, its audio so far replayed to the encoder (the
  cancel purged it there).

What it costs: the agent falls silent as fast as under `immediate` (from the first voiced
frame), but the cancel, and the answer to the caller's words, wait for their transcript.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

from gateway.config import InterruptionsConfig

# sounds people make while listening; never a word that counts
_HUM = re.compile(r"^(?:[hm]+|u+[hm]*|a+h+|o+h+|e+r*m*|mhm+|uhhuh|huh)$")


def words_that_count(text: str, backchannels: Iterable[str]) -> list[str]:
    """The words of a transcript that would make it an interruption: neither hums nor words
    of a backchannel phrase ("mm hmm", "yeah", "i see")."""
    allowed = {word for phrase in backchannels for word in phrase.lower().split()}
    words = re.findall(r"[a-z']+", text.lower().replace("-", " "))
    return [w for w in words if w.strip("'") and not _HUM.match(w) and w not in allowed]


class Interruption(enum.Enum):
    """What a sound over the agent does to the reply the caller hears."""

    NONE = "none"  # nothing: the agent plays on (or there is nothing to stop)
    CUT = "cut"  # the reply is cut and the stages purged of it: a barge-in
    PAUSE = "pause"  # the reply is held where it is while the sound is settled
    RESUME = "resume"  # the sound was no interruption: the paused reply plays on


class InterruptionPolicy:
    """The interruptions section's decisions over what the session knows: whether the
    session's turn detection interrupts at all, whether a reply is playing, the voiced time
    and the transcript of the sound over it."""

    def __init__(self, config: InterruptionsConfig) -> None:
        self.config = config

    @property
    def provisional(self) -> bool:
        return self.config.policy == "provisional"

    def at_onset(self, interrupts: bool, reply_playing: bool, can_pause: bool) -> Interruption:
        """The VAD calls the caller's sound speech. `reply_playing`: a reply with audio is
        what the caller hears; `can_pause`: the transport plays it out itself (a WebSocket
        client plays what it was sent, so only WebRTC and the phone can pause and play on).
        CUT also stands for a reply asked and not yet started, which a barge-in cancels."""
        if not interrupts:
            return Interruption.NONE
        if self.provisional and reply_playing and can_pause:
            return Interruption.PAUSE
        return Interruption.CUT

    def holds_while_unsure(self, interrupts: bool, unsure: bool) -> bool:
        """The caller's voice has begun and the VAD has not yet called it speech: the agent
        goes quiet from that frame on (nothing dropped) if the sound could interrupt."""
        return unsure and interrupts and self.config.hold_on_voice

    def spoke_on(self, voiced_ms: int) -> bool:
        """A provisional turn has been voiced this long: an interruption without its words."""
        return voiced_ms >= self.config.confirm_ms

    def settle(self, transcript: str, voiced_ms: int) -> Interruption:
        """A provisional turn's transcript is in: CUT (it interrupts, its words are answered)
        or RESUME (it was none)."""
        words = words_that_count(transcript, self.config.backchannels)
        counts = bool(words) and voiced_ms >= self.config.min_speech_ms
        return Interruption.CUT if counts else Interruption.RESUME
