"""One reply of the agent, from the moment it is asked for to the moment the caller has heard
it (or stopped hearing it), and what the session keeps of the vocoder's records meanwhile.

A reply is asked for (a caller's turn ends, or the client sends response.create), starts when
the reasoning stage says so (RESPONSE_STARTED), is generated once both its text (RESPONSE_DONE,
on reasoning's ring) and its audio (AUDIO_DONE, on the vocoder's ring) are in, in either order,
and ends played to its end, or cut: by a barge-in, a client's cancel or truncate, or a reply
that supersedes it.
"""

from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.conversation import Item
from stages.envelope import Envelope

logger = logging.getLogger(__name__)

VOICE_AHEAD_MAX = 600  # vocoder records kept for a reply whose start has not come (~60 s)


class ReplyState(enum.Enum):
    ASKED = "asked"  # asked of the stages; not started
    STARTED = "started"  # its text, and audio if spoken, coming in
    GENERATED = "generated"  # all of it is in; the caller may still be hearing it
    PLAYED = "played"  # the caller heard it to its end
    CUT = "cut"  # stopped before its end


class ReplyStateError(RuntimeError):
    """A reply was moved to a state it cannot reach from the one it is in."""


_NEXT = {
    ReplyState.ASKED: {ReplyState.STARTED, ReplyState.CUT},
    ReplyState.STARTED: {ReplyState.GENERATED, ReplyState.CUT},
    ReplyState.GENERATED: {ReplyState.PLAYED, ReplyState.CUT},
    ReplyState.PLAYED: set(),
    ReplyState.CUT: set(),
}


@dataclass
class SpokenTracker:
    """Which text of a reply the caller has heard, from PHRASE marks and audio played."""

    phrases: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, text)
    samples: int = 0
    truncated_at: int | None = None  # samples the item was cut to (conversation.item.truncated)

    def phrase(self, text: str) -> None:
        self.phrases.append((self.samples, self.samples, text))

    def audio(self, n_samples: int) -> None:
        self.samples += n_samples
        if self.phrases:
            start, _, text = self.phrases[-1]
            self.phrases[-1] = (start, self.samples, text)

    def heard(self, played_samples: int, transcript: str | None = None) -> str:
        """Whole phrases played, plus the share of words of the one cut off; given the
        reply's `transcript`, as the prefix of it they make up."""
        words: list[str] = []
        for start, end, text in self.phrases:
            if played_samples >= end:
                words += text.split()
            elif played_samples > start:
                parts = text.split()
                words += parts[: int(len(parts) * (played_samples - start) / (end - start))]
        heard = " ".join(words)
        return heard if transcript is None else _prefix_spelling(transcript, heard)


def _prefix_spelling(transcript: str, heard: str) -> str:
    """The prefix of `transcript` spelling `heard`'s characters. Phrases are cut without
    their whitespace and sometimes inside a word (text without spaces), so joining them
    with spaces may not spell the transcript's words; `heard` if it is not such a prefix."""
    wanted = "".join(heard.split())
    done = 0
    for i, char in enumerate(transcript):
        if done == len(wanted):
            return transcript[:i].rstrip()
        if char.isspace():
            continue
        if char != wanted[done]:
            return heard
        done += 1
    return transcript if done == len(wanted) else heard


@dataclass
class Reply:
    """A reply and where it stands. Until it starts, `response_id` is the client's (a
    response.create) or None (a turn's, which the reasoning stage names as it starts it)."""

    response_id: str | None
    metadata: dict[str, Any] | None = None  # response.create's
    state: ReplyState = ReplyState.ASKED
    # set as it starts:
    item: Item | None = None  # its message; with tools, made as its first words come
    outputs: list[Item] = field(default_factory=list)  # its output items, in order
    calls: dict[int, Item] = field(default_factory=dict)  # its calls, by their index in it
    tools: bool = False  # it may call functions (and then may say nothing)
    mcp_running: int = 0  # MCP calls not yet answered: it is not generated before they are
    audio: bool = True  # spoken (False: text only)
    started_ns: int = 0  # the RESPONSE_STARTED record's stamp
    tracker: SpokenTracker = field(default_factory=SpokenTracker)
    text: str = ""
    text_done: bool = False  # RESPONSE_DONE came
    usage: dict[str, Any] | None = None  # what its RESPONSE_DONE reported (gateway.events)
    audio_done: bool = False  # AUDIO_DONE came
    first_audio_ns: int = 0
    samples: int = 0  # audio at the vocoder's rate handed to the transport
    playback_start: Any = None  # the transport's mark of where its audio began

    def move(self, state: ReplyState) -> None:
        if state not in _NEXT[self.state]:
            raise ReplyStateError(
                f"reply {self.response_id} cannot go from {self.state.value} to {state.value}"
            )
        self.state = state

    def start(self, response_id: str, audio: bool, tools: bool, started_ns: int) -> None:
        self.move(ReplyState.STARTED)
        self.response_id = response_id
        self.audio = audio
        self.tools = tools
        self.started_ns = started_ns

    def output_index(self, item: Item) -> int:
        return self.outputs.index(item)

    @property
    def function_calls(self) -> list[Item]:
        """Its calls of the client's functions (not MCP calls), made whole."""
        return [
            item
            for item in self.calls.values()
            if item.type == "function_call" and item.status == "completed"
        ]

    @property
    def in_progress(self) -> bool:
        """Started, and not all of it is in yet."""
        return self.state is ReplyState.STARTED


class VoiceAhead:
    """Vocoder records that come before their reply's start.

    The vocoder's records come on their own ring and reasoning's on another, whose reader
    threads race: a reply's first phrase and audio can reach the loop before its
    RESPONSE_STARTED (a reply made at the caller's pause is released with both at once). Audio
    names no reply; the vocoder's last PHRASE (or AUDIO_DONE) says whose it is, and the records
    of a reply not started yet wait here for its start."""

    def __init__(self) -> None:
        self.voiced: str | None = None  # the reply the vocoder's records are for now
        self.records: list[Envelope] = []
        self._started: collections.deque[str] = collections.deque(maxlen=32)  # started here

    def keep(self, env: Envelope, response_id: str | None) -> bool:
        """Keep a vocoder record (`response_id`: the one it names, None for audio) whose reply
        has not started yet; True when kept."""
        if response_id is not None and response_id != self.voiced:
            self.voiced, self.records = response_id, []  # a reply never started is let go
        if self.voiced is None or self.voiced in self._started:
            return False
        if len(self.records) >= VOICE_AHEAD_MAX:
            logger.warning("reply %s never started; its audio is dropped", self.voiced)
            self.records.clear()
        self.records.append(env)
        return True

    def started(self, response_id: str) -> list[Envelope]:
        """A reply started: the records kept for it, in order."""
        self._started.append(response_id)
        ahead, self.records = self.records, []
        return ahead if self.voiced == response_id else []

    def clear(self) -> None:
        """A cancel: what was kept is of a reply that will never start."""
        self.records.clear()

    def owns(self, response_id: str) -> bool:
        """Whether audio now is `response_id`'s (not the rest of a reply it superseded)."""
        return self.voiced is None or self.voiced == response_id
