"""stages.conversation: the messages the model is prompted with."""

from __future__ import annotations

from stages.config import ReasoningConfig
from stages.conversation import Conversation


def test_examples_come_between_the_system_prompt_and_the_history_and_are_never_cut() -> None:
    config = ReasoningConfig.model_validate(
        {"examples": [{"user": "What color is grass?", "assistant": "Grass is green."}]}
    )
    conversation = Conversation("be brief", max_messages=2, examples=config.example_messages)
    for text in ("one", "two", "three"):
        conversation.add("user", text)
    prompt = conversation.prompt()
    assert [m["content"] for m in prompt] == [
        "be brief",
        "What color is grass?",
        "Grass is green.",
        "two",
        "three",
    ]
    assert conversation.prompt("other")[0]["content"] == "other"  # instructions replace it


def test_an_example_without_its_answer_is_refused() -> None:
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="assistant"):
        ReasoningConfig.model_validate({"examples": [{"user": "hi"}]})
