"""The reasoning stage's copy of a conversation, as the chat messages the model is prompted with.

It appends the caller's transcripts and its own replies itself; a client's edits replace it
whole (History), and a reply cut short is kept as far as the caller heard it. Before each
reply it is fitted to the model's context in tokens, oldest messages dropped first, so that a
long call never fails a turn (`fit`).

Under speech-in a caller's turn is its audio rows (`add_audio`; stages.speech_in), with its
transcript beside them once the recognizer has it. Fitting, the oldest such turns become
their transcripts first (a transcript is a few tokens a second, the rows 6 to 25), and only
then do the oldest messages go. A client's edit keeps a turn's rows where its text is the
transcript still.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stages.messages import History, HistoryMessage, ToolCall

Message = dict[str, Any]  # an OpenAI chat message: role, content, tool_calls, tool_call_id


@dataclass
class ChatHistory:
    """One session's chat history for the model: a system prompt, example exchanges that are
    not part of the history, and the last messages."""

    system_prompt: str
    max_messages: int
    messages: list[Message] = field(default_factory=list)
    examples: list[Message] = field(default_factory=list)

    def add(self, role: str, text: str, tool_calls: list[ToolCall] | None = None) -> Message | None:
        """Append a message (none for empty text and no calls); returns it, to take it back
        by identity. An assistant's `tool_calls` follow its text."""
        if not text and not tool_calls:
            return None
        message: Message = {"role": role, "content": text}
        if tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in tool_calls
            ]
        return self._append(message)

    def add_audio(self, rows: Any, turn_id: int) -> Message:
        """A caller's turn as its audio rows (speech-in); its transcript comes later."""
        return self._append(
            {"role": "user", "content": "", "audio": rows, "turn_id": turn_id, "transcript": None}
        )

    def transcribed(self, turn_id: int, text: str) -> bool:
        """The transcript of turn `turn_id`'s audio; False if the history holds no such turn."""
        for m in reversed(self.messages):
            if m.get("turn_id") == turn_id and "audio" in m:
                m["transcript"] = m["content"] = text
                return True
        return False

    def add_output(self, call_id: str, output: str) -> Message:
        """A function's output, for the call `call_id`."""
        return self._append({"role": "tool", "tool_call_id": call_id, "content": output})

    def _append(self, message: Message) -> Message:
        self.messages.append(message)
        excess = len(self.messages) - self.max_messages
        if excess > 0:
            del self.messages[:excess]
            # a function's output with its call gone is a message no template renders
            while self.messages and self.messages[0]["role"] == "tool":
                del self.messages[0]
        return message

    def take_back(self, message: Message | None) -> None:
        """Remove a message `add` returned (if the history still holds it)."""
        for i, m in enumerate(self.messages):
            if m is message:
                del self.messages[i]
                return

    def replace(self, history: History) -> None:
        spoken = [m for m in self.messages if m.get("audio") is not None and m["transcript"]]
        self.messages = []
        for m in history.messages:
            words = m.text if m.role == "user" else None
            same = (i for i, s in enumerate(spoken) if s["transcript"] == words)
            if (i := next(same, None)) is None:
                self._add_history(m)
            else:  # still the turn it was: its rows stay
                self._append(spoken[i])
                del spoken[: i + 1]

    def _add_history(self, m: HistoryMessage) -> None:
        if m.role == "tool":
            self.add_output(m.call_id or "", m.text)
        else:
            self.add(m.role, m.text, m.tool_calls)

    def fit(
        self,
        instructions: str | None,
        count_tokens: Callable[[list[Message]], int],
        budget: int,
        overhead_bytes: int = 0,
    ) -> int:
        """Drop the oldest messages until the prompt is at most `budget` tokens (as
        `count_tokens` counts a prompt, template and tools included); the last message left
        too long keeps its end. Counts only when the prompt's UTF-8 size (with
        `overhead_bytes` of tools) says it may not fit (a token is at least a byte). Returns
        how many messages were dropped."""
        prompt = self.prompt(instructions)
        if overhead_bytes + sum(_size(m) for m in prompt) <= budget:
            return 0
        dropped = 0
        tokens = count_tokens(prompt)
        spoken = [m for m in self.messages if m.get("audio") is not None]
        while tokens > budget and spoken:  # the oldest audio turns become their words first
            m = spoken.pop(0)
            del m["audio"]
            m["content"] = m["transcript"] or ""
            prompt = self.prompt(instructions)
            tokens = count_tokens(prompt)
        while tokens > budget and len(self.messages) > 1:
            # drop about as many as the excess needs (by their share of the text), then count
            excess = (tokens - budget) / tokens
            text = sum(_size(m) for m in prompt)
            share = 0
            while self.messages and len(self.messages) > 1 and share < excess * text:
                share += _size(self.messages.pop(0))
                dropped += 1
            while len(self.messages) > 1 and self.messages[0]["role"] == "tool":
                self.messages.pop(0)  # its call went
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

    def prompt(self, instructions: str | None = None) -> list[Message]:
        system = {"role": "system", "content": instructions or self.system_prompt}
        return [system, *self.examples, *self.messages]

    def truncate(self, spoken_text: str) -> None:
        """Replace the last assistant message with what the caller heard of it (none: drop
        it)."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                if spoken_text or m.get("tool_calls"):
                    m["content"] = spoken_text
                else:
                    self.messages.remove(m)
                return


def _size(message: Message) -> int:
    """About how many bytes a message takes in the prompt (a token is at least one; an audio
    row is one position)."""
    size = len(message["content"].encode("utf-8")) + 8
    if (rows := message.get("audio")) is not None:
        size += len(rows)
    for call in message.get("tool_calls", ()):
        function = call["function"]
        size += len(function["name"]) + len(function["arguments"].encode("utf-8")) + 32
    return size
