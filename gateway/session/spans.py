"""The OpenTelemetry spans of one session's turns and cancels, made through gateway.tracing.

A turn's trace is a root `turn`, from the VAD's onset to its reply played to its end, cut or
failed (or to the turn's transcript, when no reply answers it), with a child per hop:

    vad                    onset -> the turn's end decided (SPEECH_STOPPED sent)
    encoder                the turn's end -> its final transcript (the encoder's stamp)
    reasoning.first_token  RESPONSE_STARTED -> the first TEXT_DELTA (reasoning's stamps)
    vocoder.first_audio    the first TEXT_DELTA -> the first audio handed to the transport
    playout                the first audio -> played to its end, or cut

A reply the client asked for (response.create) has a `turn` of its own, from the ask. A
cancel is a `cancel` span from its send to the last stage's acknowledgement, under the turn
whose reply it cut (a root when it cut none), with a `cancel.<stage>` child per stage.

A hop's span is made once both its ends are known, from stamps taken anyway, so a session
holds only its open roots. With tracing off a session has `NO_SPANS`, whose hooks do nothing.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.rings import STAGES

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.protocol import SessionConfig
    from gateway.session.outbox import Outbox
    from gateway.session.reply import Reply
    from gateway.tracing import Tracing
    from stages.messages import TextDelta, Transcript

OPEN_KEPT = 16  # turns, replies and cancels whose root is open, at most; an older one ends


class Spans:
    """The points of a session's turns and cancels that its trace marks; these mark nothing
    (tracing off). Times are CLOCK_MONOTONIC ns."""

    def turn_begun(self, turn_id: int) -> None:
        """The caller's turn `turn_id` began (the VAD's onset, or a commit)."""

    def turn_ended(self, turn_id: int, ended_ns: int, silence_ms: int, answered: bool) -> None:
        """Its end went to the stages at `ended_ns`, after `silence_ms` of the caller's
        silence; `answered`: a reply is asked for it."""

    def transcript(self, msg: Transcript, t_ns: int) -> None:
        """A TRANSCRIPT record, stamped `t_ns` by the encoder."""

    def asked(self, response_id: str) -> None:
        """A reply was asked for by name (response.create)."""

    def unanswered(self) -> None:
        """The reply the last turn asked for will not come."""

    def reply_started(self, reply: Reply, turn_id: int) -> None:
        """RESPONSE_STARTED: `reply` answers the caller's turn `turn_id` (-1: none)."""

    def text_delta(self, reply: Reply, msg: TextDelta, t_ns: int) -> None:
        """A TEXT_DELTA of `reply`, stamped `t_ns` by the reasoning stage."""

    def first_audio(self, reply: Reply) -> None:
        """`reply`'s first audio went to the transport (at `reply.first_audio_ns`)."""

    def generated(self, reply: Reply, status: str) -> None:
        """All of `reply` is in; `status` is its response.done's."""

    def played(self, reply: Reply) -> None:
        """The caller heard `reply` to its end."""

    def cut(self, reply: Reply, reason: str, heard_samples: int, failed: bool) -> None:
        """`reply` stopped after `heard_samples` of its audio (`failed`: a stage was lost)."""

    def cancel_sent(
        self, cancel_id: int, sent_ns: int, reason: str, response_id: str | None
    ) -> None:
        """A CANCEL went to every stage at `sent_ns`."""

    def cancel_acked(self, cancel_id: int, stage: str, t_ns: int, kv_usage: float | None) -> None:
        """A stage acknowledged it, having stopped everything at `t_ns`."""

    def close(self) -> None:
        """The session is closed: what is open ends now."""


NO_SPANS = Spans()


@dataclass
class TurnTrace:
    """A turn's root span and the stamps its hops are made from (0: not yet)."""

    root: Span
    turn_id: int
    begun_ns: int = 0  # the VAD's onset; 0 for a reply asked by name
    ended_ns: int = 0  # the turn's end went to the stages
    transcribed: bool = False
    answered: bool = False  # a reply is asked for it
    response_id: str | None = None
    started_ns: int = 0
    first_token_ns: int = 0
    first_audio_ns: int = 0
    done: bool = False


@dataclass
class CancelTrace:
    span: Span
    sent_ns: int
    acks: dict[str, int] = field(default_factory=dict)  # stage -> its stamp


def session_spans(
    tracing: Tracing | None,
    call_id: str,
    session: int,
    config: SessionConfig,
    outbox: Outbox,
    vocoder_rate: int,
) -> Spans:
    """A session's traces: SessionSpans where the process traces, else NO_SPANS."""
    if tracing is None:
        return NO_SPANS
    return SessionSpans(tracing, call_id, session, config, outbox, vocoder_rate)


class SessionSpans(Spans):
    """One session's open traces, marked as its turns, replies and cancels go."""

    def __init__(
        self,
        tracing: Tracing,
        call_id: str,
        session: int,
        config: SessionConfig,
        outbox: Outbox,
        vocoder_rate: int,
    ) -> None:
        self.tracing, self.config, self.outbox = tracing, config, outbox
        self.vocoder_rate = vocoder_rate
        # on every root: Langfuse and Phoenix both group traces by session.id
        self.ids = {"session.id": call_id, "omni.pipeline.session": session}
        self.turns: collections.OrderedDict[int, TurnTrace] = collections.OrderedDict()
        self.replies: collections.OrderedDict[str, TurnTrace] = collections.OrderedDict()
        self.speaking: TurnTrace | None = None  # the turn whose end is to come
        self.asking: TurnTrace | None = None  # the last turn ended, asking for a reply
        self.asked_ns: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.cancels: collections.OrderedDict[int, CancelTrace] = collections.OrderedDict()

    # -- the caller's turns ----------------------------------------------------------------

    def turn_begun(self, turn_id: int) -> None:
        now = time.monotonic_ns()
        if self.speaking is not None:  # never ended: cleared, or begun again as another
            self._finish(self.speaking, "abandoned", now)
        trace = self._root(turn_id, now, "caller")
        trace.begun_ns = now
        self.turns[turn_id] = self.speaking = trace
        while len(self.turns) > OPEN_KEPT:
            self._finish(next(iter(self.turns.values())), "unfinished", now)

    def turn_ended(self, turn_id: int, ended_ns: int, silence_ms: int, answered: bool) -> None:
        trace = self.turns.get(turn_id)
        if trace is None or trace.ended_ns:
            return
        if self.speaking is trace:
            self.speaking = None
        trace.ended_ns = ended_ns or time.monotonic_ns()
        vad = {} if self.config.turn_detection is None else {"omni.vad.silence_ms": silence_ms}
        self._hop(trace, "vad", trace.begun_ns, trace.ended_ns, vad)
        trace.answered = answered
        if answered and trace.response_id is None:
            self.asking = trace

    def transcript(self, msg: Transcript, t_ns: int) -> None:
        trace = self.turns.get(msg.turn_id)
        if not msg.final or trace is None or not trace.ended_ns or trace.transcribed:
            return
        trace.transcribed = True
        t_ns = t_ns or time.monotonic_ns()
        self._hop(trace, "encoder", trace.ended_ns, t_ns, {"omni.transcript.chars": len(msg.text)})
        if trace.response_id is None and not (msg.text and trace.answered):
            self._finish(trace, "no_reply" if msg.text else "no_speech", t_ns)

    # -- the agent's replies ---------------------------------------------------------------

    def asked(self, response_id: str) -> None:
        self.asked_ns[response_id] = time.monotonic_ns()
        while len(self.asked_ns) > OPEN_KEPT:
            self.asked_ns.popitem(last=False)

    def unanswered(self) -> None:
        trace, self.asking = self.asking, None
        if trace is not None and trace.response_id is None:
            self._finish(trace, "unanswered", time.monotonic_ns())

    def reply_started(self, reply: Reply, turn_id: int) -> None:
        response_id = reply.response_id
        assert response_id is not None
        started = reply.started_ns or time.monotonic_ns()
        asked = self.asked_ns.pop(response_id, 0)
        trace = self.turns.get(turn_id) if turn_id >= 0 else None
        if trace is None or trace.response_id is not None:
            source = "caller" if turn_id >= 0 else "response.create"
            trace = self._root(turn_id, asked or started, source)
        if self.asking is trace:
            self.asking = None
        trace.response_id, trace.started_ns = response_id, started
        trace.root.set_attribute("omni.response.id", response_id)
        self.replies[response_id] = trace
        while len(self.replies) > OPEN_KEPT:
            self._finish(next(iter(self.replies.values())), "unfinished", started)

    def text_delta(self, reply: Reply, msg: TextDelta, t_ns: int) -> None:
        trace = self.replies.get(reply.response_id or "")
        if msg.index or trace is None or trace.first_token_ns:
            return
        trace.first_token_ns = t_ns or time.monotonic_ns()
        since_submit = {"omni.reasoning.since_submit_ms": msg.since_submit_ns / 1e6}
        self._hop(
            trace, "reasoning.first_token", trace.started_ns, trace.first_token_ns, since_submit
        )
        if trace.first_audio_ns:  # the vocoder's ring was read first
            self._voiced(trace)

    def first_audio(self, reply: Reply) -> None:
        trace = self.replies.get(reply.response_id or "")
        if trace is None or trace.first_audio_ns:
            return
        trace.first_audio_ns = reply.first_audio_ns
        root = trace.root
        root.set_attribute(
            "omni.time_to_first_audio_ms", _ms(reply.first_audio_ns, trace.started_ns)
        )
        if trace.ended_ns:
            root.set_attribute("omni.turn_latency_ms", _ms(reply.first_audio_ns, trace.ended_ns))
        if trace.first_token_ns:
            self._voiced(trace)

    def generated(self, reply: Reply, status: str) -> None:
        trace = self.replies.get(reply.response_id or "")
        if trace is None:
            return
        trace.root.set_attribute("omni.response.status", status)
        if status == "failed":
            self.tracing.fail(trace.root, "the reply failed")
        if not reply.audio:  # text: the client has it all
            self._finish(trace, "sent", time.monotonic_ns())

    def played(self, reply: Reply) -> None:
        trace = self.replies.get(reply.response_id or "")
        if trace is not None:
            audio = {"omni.audio_ms": reply.samples * 1000 // self.vocoder_rate}
            self._finish(trace, "played", time.monotonic_ns(), audio)

    def cut(self, reply: Reply, reason: str, heard_samples: int, failed: bool) -> None:
        trace = self.replies.get(reply.response_id or "")
        if trace is None:
            return
        trace.root.set_attribute("omni.cut.reason", reason)
        if failed:
            self.tracing.fail(trace.root, f"cut: {reason}")
        audio = {
            "omni.audio_ms": reply.samples * 1000 // self.vocoder_rate,
            "omni.heard_ms": heard_samples * 1000 // self.vocoder_rate,
        }
        self._finish(trace, "cut", time.monotonic_ns(), audio)

    # -- cancels ---------------------------------------------------------------------------

    def cancel_sent(
        self, cancel_id: int, sent_ns: int, reason: str, response_id: str | None
    ) -> None:
        sent_ns = sent_ns or time.monotonic_ns()
        trace = self.replies.get(response_id) if response_id is not None else None
        attributes: dict[str, Any] = {
            **self.ids,
            "omni.cancel.id": cancel_id,
            "omni.cancel.reason": reason,
        }
        if response_id is not None:
            attributes["omni.response.id"] = response_id
        parent = trace.root if trace is not None else None
        span = self.tracing.start("cancel", sent_ns, parent, attributes)
        self.cancels[cancel_id] = CancelTrace(span, sent_ns)
        while len(self.cancels) > OPEN_KEPT:
            self._unacknowledged(self.cancels.popitem(last=False)[1], sent_ns)

    def cancel_acked(self, cancel_id: int, stage: str, t_ns: int, kv_usage: float | None) -> None:
        cancel = self.cancels.get(cancel_id)
        if cancel is None or stage in cancel.acks:
            return
        cancel.acks[stage] = t_ns
        kv = {} if kv_usage is None else {"omni.kv_usage": kv_usage}
        self.tracing.span(f"cancel.{stage}", cancel.sent_ns, t_ns, cancel.span, kv)
        if set(STAGES) <= cancel.acks.keys():
            del self.cancels[cancel_id]
            last = max(cancel.acks.values())
            cancel.span.set_attribute("omni.cancel.latency_ms", _ms(last, cancel.sent_ns))
            self.tracing.end(cancel.span, last)

    def close(self) -> None:
        now = time.monotonic_ns()
        for trace in [*self.turns.values(), *self.replies.values()]:
            self._finish(trace, "closed", now)
        for cancel in self.cancels.values():
            self._unacknowledged(cancel, now)
        self.cancels.clear()
        self.speaking = self.asking = None

    # -- spans -----------------------------------------------------------------------------

    def _root(self, turn_id: int, start_ns: int, source: str) -> TurnTrace:
        td, transport = self.config.turn_detection, self.outbox.transport
        attributes: dict[str, Any] = {
            **self.ids,
            "omni.turn.source": source,
            "omni.transport": transport.kind if transport is not None else "none",
            "omni.turn_detection": td.type if td is not None else "none",
        }
        if turn_id >= 0:
            attributes["omni.turn.id"] = turn_id
        if isinstance(named := self.config.tracing, dict):  # the client's session.tracing
            for key in ("workflow_name", "group_id"):
                if key in named:
                    attributes[f"omni.tracing.{key}"] = named[key]
        return TurnTrace(self.tracing.start("turn", start_ns, None, attributes), turn_id)

    def _hop(
        self, trace: TurnTrace, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]
    ) -> None:
        # stamps of two processes on one clock; a hop never ends before it starts
        self.tracing.span(name, start_ns, max(start_ns, end_ns), trace.root, attributes)

    def _voiced(self, trace: TurnTrace) -> None:
        self._hop(trace, "vocoder.first_audio", trace.first_token_ns, trace.first_audio_ns, {})

    def _finish(
        self,
        trace: TurnTrace,
        outcome: str,
        end_ns: int,
        playout: dict[str, Any] | None = None,
    ) -> None:
        """End a turn's root, with the hops still in progress cut short at `end_ns`."""
        if trace.done:
            return
        trace.done = True
        short = {"omni.incomplete": True}
        if trace.begun_ns and not trace.ended_ns:
            self._hop(trace, "vad", trace.begun_ns, end_ns, short)
        elif trace.ended_ns and not trace.transcribed:
            self._hop(trace, "encoder", trace.ended_ns, end_ns, short)
        if trace.started_ns and not trace.first_token_ns:
            self._hop(trace, "reasoning.first_token", trace.started_ns, end_ns, short)
        if trace.first_audio_ns:
            attributes = {"omni.playout.outcome": outcome, **(playout or {})}
            self._hop(trace, "playout", trace.first_audio_ns, end_ns, attributes)
        trace.root.set_attribute("omni.turn.outcome", outcome)
        self.tracing.end(trace.root, end_ns)
        if self.turns.get(trace.turn_id) is trace:
            del self.turns[trace.turn_id]
        if trace.response_id is not None and self.replies.get(trace.response_id) is trace:
            del self.replies[trace.response_id]
        if self.speaking is trace:
            self.speaking = None
        if self.asking is trace:
            self.asking = None

    def _unacknowledged(self, cancel: CancelTrace, end_ns: int) -> None:
        missing = sorted(set(STAGES) - cancel.acks.keys())
        cancel.span.set_attribute("omni.cancel.unacknowledged", missing)
        self.tracing.end(cancel.span, end_ns)


def _ms(later_ns: int, earlier_ns: int) -> float:
    return round((later_ns - earlier_ns) / 1e6, 3)
