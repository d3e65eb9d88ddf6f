"""gateway.turns.interruption: what a sound over the agent does, under each policy."""

from __future__ import annotations

import pytest

from gateway.config import BACKCHANNELS, InterruptionsConfig
from gateway.turns.interruption import Interruption, InterruptionPolicy, words_that_count


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("Mm-hmm.", False),
        ("Uh huh.", False),
        ("Yeah, right.", False),
        ("I see.", False),
        ("", False),
        ("Wait, stop.", True),
        ("No, that's wrong", True),
        ("I want Berlin", True),
    ],
)
def test_words_that_count(text: str, counts: bool) -> None:
    assert bool(words_that_count(text, BACKCHANNELS)) is counts


def policy(name: str, **knobs: object) -> InterruptionPolicy:
    return InterruptionPolicy(InterruptionsConfig.model_validate({"policy": name, **knobs}))


def test_at_the_onset_immediate_cuts_and_provisional_pauses_what_it_can() -> None:
    immediate, provisional = policy("immediate"), policy("provisional")
    assert immediate.at_onset(True, reply_playing=True, can_pause=True) is Interruption.CUT
    assert provisional.at_onset(True, reply_playing=True, can_pause=True) is Interruption.PAUSE
    # a WebSocket client plays what it was sent: nothing to pause, so it is cut
    assert provisional.at_onset(True, reply_playing=True, can_pause=False) is Interruption.CUT
    # no reply to hear: a reply asked and not started is what a barge-in cancels
    assert provisional.at_onset(True, reply_playing=False, can_pause=True) is Interruption.CUT
    for p in (immediate, provisional):  # interrupt_response false: the agent plays on
        assert p.at_onset(False, reply_playing=True, can_pause=True) is Interruption.NONE


def test_an_unsure_voice_holds_the_agent_only_where_it_could_interrupt() -> None:
    assert policy("immediate").holds_while_unsure(interrupts=True, unsure=True)
    assert not policy("immediate").holds_while_unsure(interrupts=True, unsure=False)
    assert not policy("immediate").holds_while_unsure(interrupts=False, unsure=True)
    assert not policy("immediate", hold_on_voice=False).holds_while_unsure(True, True)


def test_a_provisional_turn_interrupts_by_its_words_or_its_length() -> None:
    p = policy("provisional", min_speech_ms=600, confirm_ms=1000)
    assert p.settle("Wait, stop.", 800) is Interruption.CUT
    assert p.settle("Wait, stop.", 400) is Interruption.RESUME  # too short to be sure of
    assert p.settle("Mm-hmm.", 2000) is Interruption.RESUME
    assert p.settle("", 900) is Interruption.RESUME  # a cough
    assert not p.spoke_on(980) and p.spoke_on(1000)
