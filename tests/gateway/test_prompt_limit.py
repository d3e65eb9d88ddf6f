"""Instructions and tools checked against the reasoning model's context when a session sets
them, counted with the model's tokenizer (the tiny chat model's, a real tokenizer.json)."""

from __future__ import annotations

import pytest

from gateway.fields import ProtocolError
from gateway.prompt_limit import TURN_TOKENS, PromptLimit
from gateway.protocol import SessionConfig
from stages.config import TINY_CHAT_MODEL, ReasoningConfig

CONTEXT, REPLY = 512, 64


def limit(model: str = TINY_CHAT_MODEL) -> PromptLimit:
    reasoning = ReasoningConfig(
        model=model, engine_args={"max_model_len": CONTEXT}, sampling={"max_tokens": REPLY}
    )
    return PromptLimit(reasoning)


def session(**update) -> SessionConfig:
    return SessionConfig(voice="v").updated(update)


def test_instructions_that_leave_room_for_a_reply_and_a_turn_are_taken() -> None:
    limit().check(session(instructions="Answer in one short sentence."))


def test_instructions_past_the_context_are_refused_naming_the_limit_in_tokens() -> None:
    checker = limit()
    with pytest.raises(ProtocolError) as refused:
        checker.check(session(instructions="Say something kind about the weather. " * 200))
    error = refused.value
    assert error.param == "session.instructions" and error.code == "context_length_exceeded"
    at_most = CONTEXT - REPLY - TURN_TOKENS
    assert f"holds {CONTEXT}" in str(error) and f"at most {at_most} fit" in str(error)
    # the session's own reply cap is the one counted
    with pytest.raises(ProtocolError, match="beside a reply of 200 tokens"):
        checker.check(session(instructions="word " * 300, max_output_tokens=200))


def test_tools_count_against_the_context_too() -> None:
    tool = {
        "type": "function",
        "name": "lookup",
        "description": "Looks a thing up in the big book. " * 80,
        "parameters": {"type": "object", "properties": {}},
    }
    with pytest.raises(ProtocolError, match="instructions and tools take"):
        limit().check(session(instructions="Be brief.", tools=[tool]))


def test_a_model_not_on_this_machine_is_not_checked() -> None:
    limit("someone/not-here-7b").check(session(instructions="word " * 5000))


def test_a_speech_in_models_own_tokenizer_and_context_count() -> None:
    from stages.config import TINY_OMNI, SpeechInConfig

    reasoning = ReasoningConfig(model=TINY_OMNI, speech_in=SpeechInConfig(), sampling={})
    checker = PromptLimit(reasoning)
    checker.check(session(instructions="Be brief."))
    assert checker.context is not None and checker.context > 0  # the thinker's text config's
    with pytest.raises(ProtocolError, match="instructions and tools take"):
        checker.check(session(instructions="word " * (checker.context + 10)))
