"""The caller's voice over the agent, carried out for one session: the interruption policy's
decisions (gateway.turns.interruption) become the transport's hold, a paused reply, and cuts
through gateway.session.stop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.protocol import SessionConfig
from gateway.session import stop
from gateway.session.outbox import Outbox
from gateway.session.replies import Replies
from gateway.session.reply import Reply
from gateway.session.stop import Cancels
from gateway.session.turns import CallerTurns
from gateway.turns.interruption import Interruption, InterruptionPolicy


class Interruptions:
    """What sounds over the agent do to a session's reply. `answer(text)` asks for the reply
    to the words that interrupted it; `sync_history` sends the conversation to the stages."""

    def __init__(
        self,
        policy: InterruptionPolicy,
        config: SessionConfig,
        turns: CallerTurns,
        replies: Replies,
        cancels: Cancels,
        outbox: Outbox,
        metrics: GatewayMetrics,
        log: logging.LoggerAdapter[Any],
        answer: Callable[[str], None],
        sync_history: Callable[[], None],
    ) -> None:
        self.policy, self.config, self.turns = policy, config, turns
        self.replies, self.cancels, self.outbox = replies, cancels, outbox
        self.metrics, self.log = metrics, log
        self.answer, self.sync_history = answer, sync_history
        self.paused: Reply | None = None  # the reply paused under provisional turns
        self._unsure = False  # the last frame was voiced, and not yet called speech

    @property
    def interrupts(self) -> bool:
        td = self.config.turn_detection
        return td is not None and td.interrupt_response

    def onset(self) -> bool:
        """The caller's speech began; True: their turn is provisional (it paused the reply)."""
        reply, transport = self.replies.current, self.outbox.transport
        decision = self.policy.at_onset(
            self.interrupts,
            reply_playing=reply is not None and reply.audio,
            can_pause=transport is not None and transport.holds_audio,
        )
        if decision is Interruption.PAUSE:
            assert reply is not None and transport is not None
            if self.paused is None:
                self.paused = reply
                self.log.info("reply %s paused: the caller speaks over it", reply.response_id)
            transport.hold(True)
            return True
        if decision is Interruption.CUT:
            stop.barge_in(self.replies, self.cancels, bool(self.turns.transcribing), self.log)
        return False

    def unsure(self, unsure: bool) -> None:
        """A barge-in is decided some frames after the caller's first voiced one: the agent
        goes quiet from that frame on, and plays on, nothing lost, if it was not one (or,
        paused, until the turn is known not to be one)."""
        transport = self.outbox.transport
        if transport is not None:
            judged = self.policy.holds_while_unsure(self.interrupts, unsure)
            current = self.replies.current is not None
            if judged and current and not self._unsure:  # a voice over the agent begins
                self.metrics.agent_holds.inc()
            transport.hold((judged or self.paused is not None) and current)
        self._unsure = unsure

    def voiced(self, turn_id: int, voiced_ms: int) -> None:
        """A provisional turn that goes on long enough is an interruption: the reply is cut
        (the cancel purges the turn too) and the turn begun again, as any turn."""
        if self.policy.spoke_on(voiced_ms):
            self.cut_paused()
            self.turns.begin_again()

    def settle(self, turn_id: int, text: str) -> None:
        """A provisional turn's transcript decides it: an interruption (the paused reply is
        cut, the words answered) or none (the reply plays on once nothing else is over it)."""
        voiced_ms = self.turns.voiced_ms_of.get(turn_id, 0)
        decision = self.policy.settle(text, voiced_ms)
        counts = decision is Interruption.CUT
        self.log.info(
            "over the agent: %r, %d ms voiced: %s",
            text,
            voiced_ms,
            "an interruption" if counts else "none",
        )
        item_id = self.turns.settle(turn_id, text, counts)
        paused = self.paused
        if counts:
            self.cut_paused()
            td = self.config.turn_detection
            if td is not None and td.create_response:
                self.answer(text)
            else:
                self.sync_history()
            return
        self.metrics.false_interruptions.inc()
        if paused is None or self.turns.provisional or self.turns.detector.in_speech:
            return  # another sound over the agent is still to be settled
        self.paused = None
        reply, transport = self.replies.current, self.outbox.transport
        if reply is paused and transport is not None:
            transport.hold(False)
            self.outbox.interruption_resumed(reply.response_id or "", item_id or "", text)
            self.log.info("reply %s plays on (%r was no interruption)", reply.response_id, text)

    def cut_paused(self) -> None:
        """The sound over the agent was an interruption: the reply paused for it is cut where
        it paused, as a barge-in."""
        paused, self.paused = self.paused, None
        if paused is not None and self.replies.current is paused:
            stop.cut(self.replies, self.cancels, "barge_in", self.log)
