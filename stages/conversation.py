"""The reasoning stage's copy of a conversation, as the chat messages the model is prompted with.

It appends the caller's transcripts and its own replies itself; a client's edits replace it
whole (History), and a reply cut short is kept as far as the caller heard it. Before each
reply it is fitted to the model's context in tokens, oldest messages dropped first, so that a
long call never fails a turn (`fit`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stages.messages import History


@dataclass
class Conversation:
    """One session's chat history for the model: a system prompt, example exchanges that are
    not part of the history, and the last messages."""

    system_prompt: str
    max_messages: int
    messages: list[dict[str, str]] = field(default_factory=list)
    examples: list[dict[str, str]] = field(default_factory=list)

    def add(self, role: str, text: str) -> dict[str, str] | None:
        """Append a message (none for empty text); returns it, to take it back by identity."""
        if not text:
            return None
        message = {"role": role, "content": text}
        self.messages.append(message)
        del self.messages[: max(0, len(self.messages) - self.max_messages)]
        return message

    def take_back(self, message: dict[str, str] | None) -> None:
        """Remove a message `add` returned (if the history still holds it)."""
        for i, m in enumerate(self.messages):
            if m is message:
                del self.messages[i]
                return

    def replace(self, history: History) -> None:
        self.messages = []
        for m in history.messages:
            self.add(m.role, m.text)

    def fit(
        self,
        instructions: str | None,
        count_tokens: Callable[[list[dict[str, str]]], int],
        budget: int,
    ) -> int:
        """Drop the oldest messages until the prompt is at most `budget` tokens (as
        `count_tokens` counts a prompt, template included); the last message left too long
        keeps its end. Counts only when the prompt's UTF-8 size says it may not fit (a token
        is at least a byte). Returns how many messages were dropped."""
        prompt = self.prompt(instructions)
        if sum(len(m["content"].encode("utf-8")) + 8 for m in prompt) <= budget:
            return 0
        dropped = 0
        tokens = count_tokens(prompt)
        while tokens > budget and len(self.messages) > 1:
            # drop about as many as the excess needs (by their share of the text), then count
            excess = (tokens - budget) / tokens
            text = sum(len(m["content"]) + 8 for m in prompt)
            share = 0
            while self.messages and len(self.messages) > 1 and share < excess * text:
                share += len(self.messages.pop(0)["content"]) + 8
                dropped += 1
            prompt = self.prompt(instructions)
            tokens = count_tokens(prompt)
        if tokens > budget and self.messages:  # one message longer than the context
            last = self.messages[-1]
            while tokens > budget and last["content"]:
                keep = int(len(last["content"]) * budget / tokens * 0.9)
                last["content"] = last["content"][len(last["content"]) - keep :]
                tokens = count_tokens(self.prompt(instructions))
        return dropped

    def prompt(self, instructions: str | None = None) -> list[dict[str, str]]:
        system = {"role": "system", "content": instructions or self.system_prompt}
        return [system, *self.examples, *self.messages]

    def truncate(self, spoken_text: str) -> None:
        """Replace the last assistant message with what the caller heard of it (none: drop
        it)."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                if spoken_text:
                    m["content"] = spoken_text
                else:
                    self.messages.remove(m)
                return
