"""stages.conversation: the messages the model is prompted with."""

from __future__ import annotations

from stages.config import ReasoningConfig
from stages.conversation import ChatHistory


def test_examples_come_between_the_system_prompt_and_the_history_and_are_never_cut() -> None:
    config = ReasoningConfig.model_validate(
        {"examples": [{"user": "What color is grass?", "assistant": "Grass is green."}]}
    )
    conversation = ChatHistory("be brief", max_messages=2, examples=config.example_messages)
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


def words(prompt: list[dict[str, str]]) -> int:
    """A stand-in tokenizer: a token a word, and two a message for its template."""
    return sum(len(m["content"].split()) + 2 for m in prompt)


def test_a_long_history_is_fitted_to_the_context_oldest_first() -> None:
    conversation = ChatHistory("be brief", max_messages=1000)
    for turn in range(200):
        conversation.add("user", f"question {turn} " + "word " * 20)
        conversation.add("assistant", f"answer {turn} " + "word " * 20)
    dropped = conversation.fit(None, words, budget=500)
    assert dropped > 0 and words(conversation.prompt()) <= 500
    # the newest messages stay, in order, and the system prompt is never dropped
    assert conversation.messages[-1]["content"].startswith("answer 199")
    assert conversation.prompt()[0]["content"] == "be brief"
    kept = len(conversation.messages)
    assert kept == 400 - dropped and kept >= 20  # what fits is kept, not a few messages


def test_a_prompt_that_fits_is_not_counted_and_nothing_is_dropped() -> None:
    conversation = ChatHistory("be brief", max_messages=10)
    conversation.add("user", "hello there")

    def never(prompt: list[dict[str, str]]) -> int:
        raise AssertionError("counted a prompt whose size shows it fits")

    assert conversation.fit(None, never, budget=100) == 0
    assert len(conversation.messages) == 1


def test_one_message_longer_than_the_context_keeps_its_end() -> None:
    conversation = ChatHistory("be brief", max_messages=10)
    conversation.add("user", "old question")
    conversation.add("user", " ".join(f"w{i}" for i in range(5000)) + " the end")
    conversation.fit(None, words, budget=300)
    assert words(conversation.prompt()) <= 300
    assert conversation.messages[-1]["content"].endswith("w4999 the end")
