"""The reasoning stage's copy of a conversation, as the chat messages the model is prompted with.

It appends the caller's transcripts and its own replies itself; a client's edits replace it
whole (History), and a reply cut short is kept as far as the caller heard it.
"""

from __future__ import annotations

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
