"""The caller's voice over the agent under the provisional policy (GatewayConfig.interruptions):
a turn begun while a reply plays pauses it, and is an interruption only once it proves to be.

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

import re
from collections.abc import Iterable

# sounds people make while listening; never a word that counts
_HUM = re.compile(r"^(?:[hm]+|u+[hm]*|a+h+|o+h+|e+r*m*|mhm+|uhhuh|huh)$")


def words_that_count(text: str, backchannels: Iterable[str]) -> list[str]:
    """The words of a transcript that would make it an interruption: neither hums nor words
    of a backchannel phrase ("mm hmm", "yeah", "i see")."""
    allowed = {word for phrase in backchannels for word in phrase.lower().split()}
    words = re.findall(r"[a-z']+", text.lower().replace("-", " "))
    return [w for w in words if w.strip("'") and not _HUM.match(w) and w not in allowed]
