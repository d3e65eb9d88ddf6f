"""Every way a reply is stopped, and the cancels that purge the stages for it.

A stop ends what the caller hears at once (queued audio dropped) and tells the client what
they heard. Whether it also cancels decides whether the stages are purged:

- `cut`: the reply the caller hears is stopped, and one CANCEL purges every stage (an epoch
  bump, stages.stops) and is acknowledged by each: barge-in, response.cancel,
  output_audio_buffer.clear, conversation.item.truncate, a response.create over it.
- `let_go`: the stages moved on by themselves (a reply they started supersedes this one), so
  nothing is cancelled: a cancel would purge the new reply as well.
- `stop_unheard`: a reply that starts while the caller is speaking again is dropped by name
  (RESPONSE_STOP), without a cancel, which would purge the turn they are in.
- `cancel_asked`: a reply a turn asked for and that has not started is cancelled before it can
  start over the caller (the client never heard of it).

`barge_in` is what speech onset does with them. `lost`: a stage died under the session, and
the supervisor purged it already; its replies end failed.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.session.outbox import Outbox
from gateway.session.replies import Replies
from gateway.session.reply import Reply, ReplyState
from gateway.session.spans import NO_SPANS, Spans
from stages.link import PipelineLink
from stages.rings import STAGES

SENT_KEPT = 256  # cancels whose send time is kept for the latency of their acks


@dataclass
class PendingCancel:
    """The cancel of a reply being cut, until every stage has acknowledged it."""

    response_id: str
    sent_ns: int
    acks: dict[str, int] = field(default_factory=dict)  # stage -> its CLOCK_MONOTONIC ns
    # stage -> its vLLM engine's KV usage after the abort (reasoning; a talker voice's vocoder)
    kv_usage: dict[str, float] = field(default_factory=dict)


class Cancels:
    """The session's cancels: each sent through the link, its acks counted; a reply's is
    announced to the client (omni.response.cancelled) once every stage has acknowledged."""

    def __init__(
        self,
        link: PipelineLink,
        session: int,
        outbox: Outbox,
        metrics: GatewayMetrics,
        spans: Spans = NO_SPANS,
    ) -> None:
        self.link, self.session, self.outbox, self.metrics = link, session, outbox, metrics
        self.spans = spans
        self.sent: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> ns
        self.pending: dict[int, PendingCancel] = {}

    def send(self, response_id: str | None, heard: str, reason: str) -> int:
        """Purge the session in every stage; returns the cancel's id. With `response_id`, the
        acknowledgements are gathered for the client."""
        cancel_id, t = self.link.cancel(self.session, response_id, heard, reason)
        self.spans.cancel_sent(cancel_id, t, reason, response_id)
        self.sent[cancel_id] = t
        while len(self.sent) > SENT_KEPT:
            self.sent.popitem(last=False)
        if response_id is not None:
            self.pending[cancel_id] = PendingCancel(response_id, t)
        return cancel_id

    def acked(self, cancel_id: int, stage: str, t_ns: int, kv: float | None) -> None:
        self.spans.cancel_acked(cancel_id, stage, t_ns, kv)
        sent = self.sent.get(cancel_id)
        if sent is not None:
            self.metrics.cancel_latency.labels(stage).observe((t_ns - sent) / 1e9)
        if kv is not None and stage == "reasoning":
            self.metrics.kv_usage.set(kv)
        pending = self.pending.get(cancel_id)
        if pending is None:
            return
        pending.acks[stage] = t_ns
        if kv is not None:
            pending.kv_usage[stage] = kv
        if set(pending.acks) >= set(STAGES):
            del self.pending[cancel_id]
            self.outbox.response_cancelled(
                pending.response_id,
                round((max(pending.acks.values()) - pending.sent_ns) / 1e6, 2),
                {s: round((t - pending.sent_ns) / 1e6, 2) for s, t in pending.acks.items()},
                pending.kv_usage,
            )


def cut(
    replies: Replies,
    cancels: Cancels,
    reason: str,
    log: logging.LoggerAdapter[Any],
    heard_samples: int | None = None,
) -> None:
    """Stop the reply the caller hears and purge every stage of it. `heard_samples` (at the
    vocoder's rate) overrides what the transport says was played, for a client that reports
    it (conversation.item.truncate); the cancel carries the heard text to reasoning."""
    silenced = _silence(replies, heard_samples, reason, log)
    if silenced is None:
        return
    reply, heard_samples = silenced
    heard = replies.heard_text(reply, heard_samples)
    assert reply.response_id is not None
    replies.forget_asked()  # the cancel purges that too
    for asked in replies.created.values():  # and the replies asked for and not started
        asked.move(ReplyState.CUT)
    replies.created.clear()
    cancels.send(reply.response_id, heard, reason)  # first: the stages stop at once
    replies.voice_ahead.clear()  # of the epoch just cancelled: its reply never starts
    _tell_client(replies, reply, reason, heard, heard_samples, log)


def let_go(replies: Replies, reason: str, log: logging.LoggerAdapter[Any]) -> None:
    """Stop playing the current reply and tell the client, cancelling nothing."""
    silenced = _silence(replies, None, reason, log)
    if silenced is not None:
        reply, heard_samples = silenced
        heard = replies.heard_text(reply, heard_samples)
        _tell_client(replies, reply, reason, heard, heard_samples, log)


def stop_unheard(
    replies: Replies, link: PipelineLink, session: int, log: logging.LoggerAdapter[Any]
) -> None:
    """The reply just started answers a turn the caller has spoken on after: reasoning and
    the vocoder drop it by name (its vLLM request aborted), and the client is told it was
    cut by the caller's turn."""
    reply = replies.current
    if reply is None or reply.response_id is None:
        return
    link.stop_response(session, reply.response_id)
    let_go(replies, "barge_in", log)


def cancel_asked(
    replies: Replies, cancels: Cancels, reason: str, log: logging.LoggerAdapter[Any]
) -> None:
    """Cancel the reply the last turn asked for, which has not started."""
    if replies.turn_asked is None:
        return
    replies.forget_asked()
    cancels.send(None, "", reason)
    replies.voice_ahead.clear()
    log.info("a reply not yet started cancelled (%s)", reason)


def barge_in(
    replies: Replies, cancels: Cancels, transcribing: bool, log: logging.LoggerAdapter[Any]
) -> None:
    """The caller started to speak: cut the reply they hear, or else cancel the one their last
    turn asked for. That one only once the turn's transcript is here: the encoder is done with
    the turn, and a cancel purges none of it (reasoning may read the transcript after the
    cancel: it keeps it, unanswered, stages.stops.survives_cancel). A reply that starts before
    then, while the caller speaks, is stopped as it starts (`stop_unheard`)."""
    if replies.current is not None:
        cut(replies, cancels, "barge_in", log)
    elif not transcribing:
        cancel_asked(replies, cancels, "barge_in", log)


def lost(replies: Replies, error: dict[str, Any], log: logging.LoggerAdapter[Any]) -> None:
    """A stage died and was purged of the session (by the supervisor, stages.supervisor):
    nothing more of its replies will come. The one being made stops and ends failed (one
    made whole plays on), the ones asked and not started are forgotten (the client has the
    `error`), so that the next response.create is taken."""
    for response_id in list(replies.created):
        replies.created.pop(response_id).move(ReplyState.CUT)
    replies.forget_asked()
    replies.voice_ahead.clear()
    if replies.current is None or not replies.current.in_progress:
        return  # all of it was made: the caller hears it to its end
    silenced = _silence(replies, None, "stage_lost", log)
    if silenced is not None:
        reply, heard_samples = silenced
        heard = replies.heard_text(reply, heard_samples)
        details = {"type": "failed", "error": error}
        _tell_client(replies, reply, "stage_lost", heard, heard_samples, log, details)


def _silence(
    replies: Replies, heard_samples: int | None, reason: str, log: logging.LoggerAdapter[Any]
) -> tuple[Reply, int] | None:
    """Drop the current reply's queued audio; the reply and how much of it the caller heard,
    or None if there is none playing. A reply whose words still played before the current
    one (`Replies.finishing`) goes quiet too: it is the one returned if there is no current
    one, else the client is told here what was heard of it."""
    reply, transport = replies.current, replies.outbox.transport
    finishing, replies.finishing = replies.finishing, None
    if transport is None or (reply is None and finishing is None):
        return None
    if reply is None:
        reply, finishing = finishing, None
    elif finishing is not None:
        heard = transport.heard_samples(finishing)
        text = replies.heard_text(finishing, heard)
        _tell_client(replies, finishing, reason, text, heard, log)
    assert reply is not None
    replies.current = None
    transport.clear()
    replies.interrupted_at.append(time.monotonic())
    if heard_samples is None:
        heard_samples = transport.heard_samples(reply)
    return reply, heard_samples


def _tell_client(
    replies: Replies,
    reply: Reply,
    reason: str,
    heard: str,
    heard_samples: int,
    log: logging.LoggerAdapter[Any],
    failed: dict[str, Any] | None = None,
) -> None:
    """The client's events for a reply cut after `heard_samples`: the cleared playback, the
    item truncated to what was heard, and the reply's end if it was still being made
    (cancelled, or with `failed`'s details, failed)."""
    assert replies.outbox.transport is not None
    if reason == "barge_in":
        replies.metrics.barge_ins.inc()
    item = reply.item  # None: a reply that had only called functions
    webrtc = replies.outbox.transport.kind == "webrtc"
    if webrtc and reply.audio and item is not None:
        replies.outbox.output_buffer_cleared(reply.response_id or "")
    if item is not None:
        item.content[0]["transcript" if reply.audio else "text"] = heard
        if webrtc and reply.audio and reply.samples:
            # as OpenAI does: over WebRTC the gateway played the audio and truncates the item
            # itself; a WebSocket client played it, and truncates it with what it heard (the
            # history holds the gateway's estimate until then), so it gets no truncation it
            # did not ask for
            reply.tracker.truncated_at = heard_samples
            replies.outbox.item_truncated(item.id, heard_samples * 1000 // replies.vocoder_rate)
    if reply.in_progress:
        replies.end_calls(reply)  # a call half made, or an MCP call whose answer is dropped
        if item is not None:
            item.status = "incomplete"
        if failed is not None:
            replies.outbox.response_done(reply, "failed", failed)
        else:
            # barge_in, or superseded: the stages started the reply to the caller's newer turn
            by = "client_cancelled" if reason.startswith("client") else "turn_detected"
            details = {"type": "cancelled", "reason": by}
            replies.outbox.response_done(reply, "cancelled", details)
    reply.move(ReplyState.CUT)
    replies.spans.cut(reply, reason, heard_samples, failed is not None)
    log.info("reply %s cut (%s); caller heard %r", reply.response_id, reason, heard)
