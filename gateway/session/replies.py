"""The agent's side of a session: the replies asked of the stages and not started, the one the
caller hears, and the stage records that make it (text, phrases, audio, ends), turned into the
client's events. How a reply is stopped is gateway.session.stop's."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gateway import events as ev
from gateway.conversation import Conversation, Item
from gateway.events import new_id
from gateway.metrics import GatewayMetrics
from gateway.session.outbox import Outbox
from gateway.session.reply import Reply, ReplyState, SpokenTracker, VoiceAhead
from gateway.session.spans import NO_SPANS, Spans
from stages.messages import ResponseDone

TRACKERS_KEPT = 32  # recent audio items whose spoken marks conversation.item.truncate may use


#: what a client reads of a reply that failed, by the reasoning stage's code for why (its log
#: has what the exception said)
FAILURES = {
    "generation_failed": "the reply could not be generated",
    "engine_dead": "the reasoning engine stopped; it is restarting",
}


def failed(code: str, message: str = "") -> dict[str, Any]:
    """response.done's status_details for a failed reply, in OpenAI's shape; `message`: the
    stage's own words for the client, where it has them."""
    code = code or "generation_failed"
    message = message or FAILURES.get(code, "the reply failed")
    return {"type": "failed", "error": {"type": "server_error", "code": code, "message": message}}


class Replies:
    """One session's replies, and the events of each."""

    def __init__(
        self,
        outbox: Outbox,
        items: Conversation,
        metrics: GatewayMetrics,
        vocoder_rate: int,
        turn_ended_ns: Callable[[], int],
        spans: Spans = NO_SPANS,
    ) -> None:
        """`turn_ended_ns`: when the caller's last turn ended, once (0 after), for the
        latency of the first audio that follows. `spans`: the session's trace."""
        self.outbox, self.items, self.metrics, self.spans = outbox, items, metrics, spans
        self.vocoder_rate = vocoder_rate
        self._turn_ended_ns = turn_ended_ns
        self.current: Reply | None = None  # started; until played to its end or cut
        # a turn's end asked the stages for a reply that has not started yet: if the caller
        # speaks again first, a barge-in cancels it before it can start over them
        self.turn_asked: Reply | None = None
        self.created: dict[str, Reply] = {}  # response.create's, not started yet
        self.voice_ahead = VoiceAhead()
        # what each recent assistant audio item said when, for conversation.item.truncate
        self.trackers: collections.OrderedDict[str, SpokenTracker] = collections.OrderedDict()
        self.interrupted_at: collections.deque[float] = collections.deque(maxlen=100)
        # called as each reply is generated (status): the session's follow-ups of its calls
        self.on_generated: Callable[[Reply, str], None] = lambda reply, status: None
        self.on_calls_ended: Callable[[Reply], None] = lambda reply: None  # ... or is cut
        # a reply that called functions, still playing its words while the reply that
        # follows the calls starts: its audio plays out before the new reply's
        self.finishing: Reply | None = None

    def current_for(self, response_id: str) -> Reply | None:
        """The current reply if it is `response_id` (records of any other are stragglers)."""
        current = self.current
        return current if current is not None and current.response_id == response_id else None

    def active(self) -> bool:
        """A reply is asked for or being made: one at a time (a reply still playing, all of
        it made, does not count: a new one supersedes it)."""
        current = self.current
        return bool(
            self.created or self.turn_asked or (current is not None and current.in_progress)
        )

    # -- asked ---------------------------------------------------------------------------------

    def ask_for_turn(self) -> None:
        if self.turn_asked is None:
            self.turn_asked = Reply(None)

    def forget_asked(self) -> None:
        """The reply the last turn asked for will not come (cancelled, or nothing to answer)."""
        if self.turn_asked is not None:
            self.turn_asked.move(ReplyState.CUT)
            self.turn_asked = None
            self.spans.unanswered()

    def ask(self, response_id: str, metadata: dict[str, Any] | None) -> None:
        """response.create sent to the stages."""
        self.created[response_id] = Reply(response_id, metadata)
        self.spans.asked(response_id)

    # -- started -------------------------------------------------------------------------------

    def start(
        self, response_id: str, turn_id: int, audio: bool, tools: bool, started_ns: int
    ) -> Reply:
        """RESPONSE_STARTED: the reply asked for becomes the one the caller hears (a reply
        still current was let go of first, gateway.session.stop). `turn_id`: the caller's
        turn it answers, -1 for a response.create's. `tools`: it may call functions, so its
        message is made only when it says something."""
        assert self.current is None
        reply = self.created.pop(response_id, None)
        if reply is None and turn_id >= 0 and self.turn_asked is not None:
            reply, self.turn_asked = self.turn_asked, None
        self.forget_asked()  # whichever started, the turn's ask is answered
        reply = reply or Reply(response_id)
        reply.start(response_id, audio, tools, started_ns)
        self.spans.reply_started(reply, turn_id)
        self.current = reply
        self.outbox.response_created(reply)
        if not tools:
            self.message(reply)
        return reply

    def message(self, reply: Reply) -> Item:
        """The reply's message item, made and announced if it has none yet."""
        if reply.item is not None:
            return reply.item
        content = (
            {"type": "output_audio", "transcript": ""}
            if reply.audio
            else {"type": "output_text", "text": ""}
        )
        item = reply.item = Item(new_id("item"), "assistant", [content], "in_progress")
        if reply.audio:
            self.trackers[item.id] = reply.tracker
            while len(self.trackers) > TRACKERS_KEPT:
                self.trackers.popitem(last=False)
        self._output(reply, item)
        self.outbox.content_part_added(reply)
        return item

    def _output(self, reply: Reply, item: Item) -> None:
        reply.outputs.append(item)
        previous = self.items.add(item)
        self.outbox.output_item_added(reply, item)
        self.outbox.item_added(item, previous)

    def text_delta(self, reply: Reply, text: str) -> None:
        self.message(reply)
        reply.text += text
        self.outbox.text_delta(reply, text)

    # -- its calls -----------------------------------------------------------------------------

    def call_started(self, reply: Reply, index: int, item: Item) -> None:
        """The reply calls a function (`item`: a function_call or an mcp_call)."""
        reply.calls[index] = item
        self._output(reply, item)

    def call_arguments(self, reply: Reply, index: int, delta: str) -> None:
        item = reply.calls.get(index)
        if item is None or item.status != "in_progress":
            return
        item.fields["arguments"] += delta
        if item.type == "function_call":
            self.outbox.function_arguments_delta(reply, item, delta)
        else:
            self.outbox.mcp_arguments_delta(reply, item, delta)

    def call_made(self, reply: Reply, index: int, arguments: str) -> None:
        """A call's arguments are whole (as the reasoning stage checked them)."""
        item = reply.calls[index]
        item.fields["arguments"] = arguments
        if item.type == "function_call":
            item.status = "completed"
            self.outbox.function_arguments_done(reply, item)
            self._call_done(reply, item)
        else:
            self.outbox.mcp_arguments_done(reply, item)
            self.outbox.mcp_call("in_progress", reply, item)
            reply.mcp_running += 1

    def call_bad(self, reply: Reply, index: int, reason: str) -> None:
        """A call the model made wrong (no such tool, arguments no JSON object): it ends
        incomplete, and the client has an `error` naming why."""
        item = reply.calls.get(index)
        if item is not None and item.status == "in_progress":
            if item.type == "mcp_call":
                item.fields["error"] = {"type": "tool_execution_error", "message": reason}
            self._call_done(reply, item, "incomplete")

    def mcp_answered(
        self, reply: Reply, item: Item, output: str | None, error: dict[str, Any] | None
    ) -> None:
        """An MCP call came back (`output`), or failed (`error`, in the API's form)."""
        if item.status != "in_progress":
            return  # cut meanwhile: the late answer is dropped
        item.fields["output"], item.fields["error"] = output, error
        self.outbox.mcp_call("failed" if error else "completed", reply, item)
        self._call_done(reply, item, "failed" if error else "completed")
        reply.mcp_running -= 1
        heard_all = reply.audio_done or not reply.audio or reply.item is None
        if reply.mcp_running == 0 and reply.text_done and heard_all:
            self._generated(reply, "completed")

    def _call_done(self, reply: Reply, item: Item, status: str = "completed") -> None:
        item.status = status
        self.outbox.item_done(item)
        self.outbox.output_item_done(reply, item)

    def end_calls(self, reply: Reply) -> None:
        """The reply was cut: the calls it was still making end incomplete (an MCP call's
        answer, should it come, is dropped)."""
        self.on_calls_ended(reply)
        for item in reply.calls.values():
            if item.status == "in_progress":
                if item.type == "mcp_call":
                    reply.mcp_running -= 1
                self._call_done(reply, item, "incomplete")

    # -- its end -------------------------------------------------------------------------------

    def text_done(self, reply: Reply, done: ResponseDone) -> None:
        """The reasoning stage finished the reply's text (the audio may still be coming)."""
        text, status = done.text, done.status
        reply.text, reply.text_done = text, True
        reply.usage = ev.usage(
            done.input_tokens, done.input_audio_tokens, done.cached_tokens, done.output_tokens
        )
        if reply.item is not None or not reply.calls:
            item = self.message(reply)
            if reply.audio:
                item.content[0]["transcript"] = text
                self.outbox.audio_transcript_done(reply)
            else:
                item.content[0]["text"] = text
                self.outbox.output_text_done(reply)
        if status == "completed" and reply.audio and not reply.audio_done and reply.item:
            return  # AUDIO_DONE finishes it
        details = failed(done.error, done.error_message) if status == "failed" else None
        self._generated(reply, status, details)

    def audio_done(self, reply: Reply) -> None:
        if reply.state is not ReplyState.STARTED:
            return  # it failed already: its response.done is out
        if (transport := self.outbox.transport) is not None and reply.item is not None:
            transport.audio_end(reply)
        if reply.item is not None:
            self.outbox.output_audio_done(reply)
        reply.audio_done = True
        if reply.text_done:
            self._generated(reply, "completed")
        # else its RESPONSE_DONE, still on reasoning's ring, finishes it with the whole text

    def _generated(self, reply: Reply, status: str, details: dict[str, Any] | None = None) -> None:
        if reply.state is not ReplyState.STARTED:
            return  # finished already (a failed reply's audio still ended)
        if status == "completed" and reply.mcp_running:
            return  # the last MCP call's answer finishes it
        if status != "completed":
            self.end_calls(reply)
        reply.move(ReplyState.GENERATED)
        self.spans.generated(reply, status)
        if (item := reply.item) is not None:
            self.outbox.content_part_done(reply)
            item.status = "completed" if status == "completed" else "incomplete"
            self.outbox.output_item_done(reply, item)
            self.outbox.item_done(item)
        self.outbox.response_done(reply, status, details)
        transport = self.outbox.transport
        if reply.audio and reply.item is not None and transport is not None:
            transport.finish(reply)  # it calls `played` once the caller has heard it all
        elif self.current is reply:
            reply.move(ReplyState.PLAYED)  # text, or calls only: the client has it all
            self.current = None
        self.on_generated(reply, status)

    def phrase(self, reply: Reply, text: str) -> None:
        self.message(reply)
        reply.tracker.phrase(text)

    def audio(self, pcm: np.ndarray) -> None:
        """A piece of the current reply's audio, to the transport."""
        reply, transport = self.current, self.outbox.transport
        if reply is None or not reply.audio or transport is None:
            return  # a reply that was cut: its stragglers are dropped
        if reply.state is not ReplyState.STARTED:
            return  # it failed, and its response.done is out: nothing of it may follow
        assert reply.response_id is not None
        if not self.voice_ahead.owns(reply.response_id):
            return  # the rest of a reply this one superseded
        self.message(reply)
        reply.tracker.audio(len(pcm))
        if not reply.first_audio_ns:
            reply.first_audio_ns = time.monotonic_ns()
            turn_ms = None
            if speech_stopped_ns := self._turn_ended_ns():
                turn_ms = (reply.first_audio_ns - speech_stopped_ns) / 1e6
                self.metrics.turn_latency.observe(turn_ms / 1000)
            first_ms = (reply.first_audio_ns - reply.started_ns) / 1e6
            self.metrics.time_to_first_audio.observe(first_ms / 1000)
            self.outbox.first_audio(reply, turn_ms, first_ms)
            self.spans.first_audio(reply)
        transport.play(reply, pcm)
        reply.samples += len(pcm)

    def played(self, response_id: str) -> None:
        """The transport played a finished reply to its end."""
        finishing = self.finishing
        if finishing is not None and finishing.response_id == response_id:
            self.finishing = None
            finishing.move(ReplyState.PLAYED)
            self.spans.played(finishing)
        elif (reply := self.current_for(response_id)) is not None:
            reply.move(ReplyState.PLAYED)
            self.current = None
            self.spans.played(reply)

    def hand_over(self) -> bool:
        """The reply that follows the current one's calls is asked for: the current one, all
        of it made, plays on before it (`finishing`). False if there is no such reply."""
        reply = self.current
        if reply is None or reply.state is not ReplyState.GENERATED or not reply.calls:
            return False
        self.finishing, self.current = reply, None
        return True

    def heard_text(self, reply: Reply, heard_samples: int) -> str:
        """What the caller heard of `reply` after `heard_samples` of its audio."""
        return reply.tracker.heard(heard_samples, reply.text) if reply.audio else reply.text
