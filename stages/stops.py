"""What stops work in a stage, and the one rule for what a stop ends.

Six records stop work, and each becomes a `Stop`:

| record | scope | ends |
| --- | --- | --- |
| CANCEL | EARLIER | all of the session's work begun before the cancel (and is acknowledged) |
| SESSION_OPEN | HOLDER | what an earlier holder of the session id left, its state included |
| SESSION_CLOSE | SESSION | all of the session's work and state begun up to the close |
| RESPONSE_STOP | REPLY | one reply, which the caller never heard |
| RESPONSE_RELEASE, keep=False | REPLY | one reply prepared at the caller's pause, never heard |
| TURN_RESUMED | PREPARED | what was prepared at the caller's pause for one turn |

A stage's `on_stop` asks the stop about every piece of work it holds for the session (a turn,
a reply, a reply prepared at the pause) and drops what it ends; what dropping means is the
stage's own business (stages.encoder, stages.reasoning, stages.vocoder).

Why epochs decide: a session's records reach a stage on several rings (a reply's start from
reasoning, the session's open and cancels from the gateway) and reader threads race, so the
new holder of a session id, or the reply a client asks for right after its cancel, can be
handled before the open or the cancel that came first. The gateway bumps the session's epoch
before it sends an open or a cancel, and every record carries the epoch it was made in: so an
open or a cancel ends only work begun in an older epoch, and a close all that began up to its
own.

What a cancel makes stale: once a session's epoch has moved past a record's, the record is not
delivered (the ring drops it as it is popped, `made_stale` drops it where it was already on its
way) unless it survives cancels: the records that manage the session, its settings and
conversation, the cancels and their answers, and a turn's final transcript.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shm import epoch_older
from stages.envelope import Envelope
from stages.messages import Cancel, Kind, ResponseRelease, ResponseStop, Transcript, TurnResumed

# delivered whatever the session's epoch: the records that manage sessions, their settings
# and conversation, and cancels (a barge-in must not undo an edit sent just before it)
UNPURGEABLE = frozenset(
    {
        Kind.SESSION_OPEN,
        Kind.SESSION_CLOSE,
        Kind.HISTORY,
        Kind.SESSION_SETTINGS,
        Kind.CANCEL,
        Kind.CANCEL_ACK,
        Kind.ERROR,
    }
)


def survives_cancel(kind: Kind, msg: object) -> bool:
    """Whether a record is delivered whatever the session's epoch: the UNPURGEABLE kinds, and a
    turn's final transcript. What the caller said stays said when a cancel comes while it is
    being transcribed (the caller spoke again before the reply to it started); reasoning keeps
    such a turn in the conversation and does not answer it."""
    if kind in UNPURGEABLE:
        return True
    return isinstance(msg, Transcript) and msg.final and not msg.speculative


def made_stale(env: Envelope, current_epoch: int) -> bool:
    """Whether a cancel (or close) has made `env` stale since it was pushed, the session's
    epoch being `current_epoch` now: what a ring drops, for a record already past it."""
    return not survives_cancel(env.kind, env.msg) and epoch_older(env.epoch, current_epoch)


class Scope(enum.Enum):
    SESSION = "session"  # all of the session, its state included, up to the stop's epoch
    HOLDER = "holder"  # all of the session begun in an epoch before the stop's
    EARLIER = "earlier"  # the work (turns, replies) begun in an epoch before the stop's
    REPLY = "reply"  # one reply, by id, that nobody heard
    PREPARED = "prepared"  # what was prepared at the caller's pause for one turn


@dataclass(frozen=True, slots=True)
class Stop:
    scope: Scope
    epoch: int  # the stop record's
    response_id: str | None = None  # REPLY: the reply
    turn_id: int | None = None  # PREPARED: the turn
    cancel: Cancel | None = None  # a CANCEL, to acknowledge; says what the caller heard
    pushed_ns: int = 0  # when the stop record was pushed (CLOCK_MONOTONIC)

    def ends(self, epoch: int) -> bool:
        """Whether the stop ends the session's work begun in `epoch` (a turn, a reply)."""
        if self.scope is Scope.SESSION:
            return not epoch_older(self.epoch, epoch)
        if self.scope in (Scope.HOLDER, Scope.EARLIER):
            return epoch_older(epoch, self.epoch)
        return False

    def ends_session(self, epoch: int) -> bool:
        """Whether it ends the session's state (its conversation, settings) made in `epoch`:
        a close, or the open of the id's next holder; a cancel keeps it."""
        return self.scope in (Scope.SESSION, Scope.HOLDER) and self.ends(epoch)

    def ends_reply(self, response_id: str, epoch: int) -> bool:
        """Whether it ends the reply `response_id`, begun in `epoch`."""
        if self.scope is Scope.REPLY:
            return response_id == self.response_id
        return self.ends(epoch)

    def ends_prepared(self, turn_id: int, epoch: int) -> bool:
        """Whether it ends what was prepared at the caller's pause in turn `turn_id`, begun in
        `epoch` (the turn itself goes on after a PREPARED stop)."""
        if self.scope is Scope.PREPARED:
            return turn_id == self.turn_id
        return self.ends(epoch)

    @property
    def unheard(self) -> bool:
        """A reply it ends was never heard, and leaves the conversation (REPLY, PREPARED); a
        cancel keeps what the caller heard of it."""
        return self.scope in (Scope.REPLY, Scope.PREPARED)


def stop_of(env: Envelope) -> Stop | None:
    """The stop a record asks for; None for a record that stops nothing."""
    kind, msg = env.kind, env.msg
    if kind is Kind.CANCEL:
        assert isinstance(msg, Cancel)
        return Stop(Scope.EARLIER, env.epoch, cancel=msg, pushed_ns=env.t_ns)
    if kind is Kind.SESSION_OPEN:
        return Stop(Scope.HOLDER, env.epoch)
    if kind is Kind.SESSION_CLOSE:
        return Stop(Scope.SESSION, env.epoch)
    if kind is Kind.RESPONSE_STOP:
        assert isinstance(msg, ResponseStop)
        return Stop(Scope.REPLY, env.epoch, response_id=msg.response_id)
    if kind is Kind.RESPONSE_RELEASE:
        assert isinstance(msg, ResponseRelease)
        return None if msg.keep else Stop(Scope.REPLY, env.epoch, response_id=msg.response_id)
    if kind is Kind.TURN_RESUMED:
        assert isinstance(msg, TurnResumed)
        return Stop(Scope.PREPARED, env.epoch, turn_id=msg.turn_id)
    return None
