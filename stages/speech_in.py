"""Speech-in as the stages run it (stages.backends.speech_in has the models): the model a
configuration names, a turn's rows as they come to the reasoning stage, and the prompt that
carries them to vLLM.

The encoder stage sends a turn's rows a window at a time (AUDIO_EMBEDDINGS); reasoning keeps
them in a `SpokenTurn` and, with `prefill_while_speaking`, prefills the conversation so far
with them after each window, a request of one token that leaves the turn's blocks in vLLM's
prefix cache. When the turn ends, the reply's prompt holds the same blocks, and only the last
window and what follows it are computed. `EmbeddedPrompt` makes both prompts from one
rendering, so that the prefill's is a prefix of the reply's, token for token and row for row.

A turn's rows are kept in the conversation beside its transcript (which the encoder's
recognizer makes off the reply's path, for the client): earlier turns stay embeddings while
they fit the context. When they no longer do, the oldest turns become their transcripts
first, then the oldest messages go (stages.conversation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.backends.speech_in import AudioLayout, SpeechInModel, load_speech_in
from stages.config import TINY_OMNI, TINY_ULTRAVOX, ReasoningConfig
from stages.messages import AudioEmbeddings

PLACEHOLDER_ID = 0  # the token id at a row's position; vLLM reads the row there instead


def speech_in_model(config: ReasoningConfig) -> SpeechInModel | None:
    """The speech-in model of `reasoning.model` when `reasoning.speech_in` is set."""
    if config.speech_in is None:
        return None
    model = config.model
    if model == TINY_ULTRAVOX:
        from stages.backends.tiny_speech_in import ensure_tiny_ultravox

        model = str(ensure_tiny_ultravox())
    elif model == TINY_OMNI:
        from stages.backends.tiny_speech_in import ensure_tiny_omni

        model = str(ensure_tiny_omni())
    return load_speech_in(model, config.speech_in.window_ms)


def rows_tensor(msg: AudioEmbeddings) -> Any:
    """The record's rows as a (rows, dim) torch tensor of its dtype (a copy, owned)."""
    import torch

    dtype = getattr(torch, msg.dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=dtype)
    return flat.view(msg.rows, msg.dim)


@dataclass
class SpokenTurn:
    """A user turn's rows as reasoning receives them, window by window."""

    turn_id: int
    epoch: int
    windows: list[Any] = field(default_factory=list)  # (rows, dim) tensors, in order
    next_seq: int = 0
    broken: bool = False  # a window went missing (a purge): the transcript carries the turn
    prefilled: int = 0  # windows a prefill request was made with
    prefill: asyncio.Task[None] | None = None  # the one in flight
    prefill_ids: list[str] = field(default_factory=list)  # every prefill request made

    def take(self, msg: AudioEmbeddings, rows: Any) -> None:
        """A window (or the last rows) in order; out of order breaks the turn."""
        if msg.seq != self.next_seq:
            self.broken = True
        self.next_seq = msg.seq + 1
        if msg.rows:
            self.windows.append(rows)

    def rows(self, extra: Any | None = None) -> Any:
        """All of the turn's rows so far (and `extra`, the open window's at a pause)."""
        import torch

        parts = [*self.windows, *([] if extra is None else [extra])]
        return torch.cat(parts) if parts else None


class EmbeddedPrompt:
    """vLLM prompts whose user turns are audio rows: the chat rendered with the model's
    template (a turn's `layout.marker` where its rows go), tokenized piece by piece between
    the markers, each marker replaced by its rows (`prompt_embeds` there, token ids elsewhere:
    vLLM's mixed prompts)."""

    def __init__(self, tokenizer: Any, layout: AudioLayout, hidden: int, dtype: Any) -> None:
        self.tokenizer, self.layout, self.hidden, self.dtype = tokenizer, layout, hidden, dtype

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        open_turn: bool = False,
    ) -> dict[str, Any]:
        """The prompt of `messages` (audio messages hold their rows under "audio"), ready for
        the reply; with `open_turn`, cut after the last audio message's rows: the prefix a
        prefill of the turn so far warms the cache with."""
        pieces, audio = self._pieces(messages, tools, chat_template)
        if open_turn:
            pieces = pieces[: len(audio)]
        return self._assemble(pieces, audio)

    def count(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> int:
        """Prompt positions of `messages` (tokens and rows), as `render` would make them."""
        pieces, audio = self._pieces(messages, tools, chat_template)
        return sum(len(p) for p in pieces) + sum(len(a) for a in audio)

    def _pieces(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        chat_template: str | None,
    ) -> tuple[list[list[int]], list[Any]]:
        plain, audio = [], []
        for message in messages:
            rows = message.get("audio")
            m = {k: v for k, v in message.items() if k not in ("audio", "turn_id", "transcript")}
            if rows is not None:
                audio.append(rows)
                m["content"] = self.layout.content
            plain.append(_with_parsed_arguments(m))
        text = self.tokenizer.apply_chat_template(
            plain,
            tools=tools or None,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        parts = text.split(self.layout.marker)
        if len(parts) != len(audio) + 1:
            raise ValueError(
                f"the rendered chat holds {len(parts) - 1} audio markers "
                f"({self.layout.marker!r}) for {len(audio)} audio turns: a message's text "
                "carries the marker, or the template drops a turn"
            )
        encode = self.tokenizer.encode
        return [encode(p, add_special_tokens=False) for p in parts], audio

    def _assemble(self, pieces: list[list[int]], audio: list[Any]) -> dict[str, Any]:
        import torch

        ids: list[int] = []
        is_token: list[bool] = []
        spans: list[tuple[int, Any]] = []
        for i, piece in enumerate(pieces):
            ids += piece
            is_token += [True] * len(piece)
            if i < len(audio):
                spans.append((len(ids), audio[i]))
                ids += [PLACEHOLDER_ID] * len(audio[i])
                is_token += [False] * len(audio[i])
        embeds = torch.zeros(len(ids), self.hidden, dtype=self.dtype)
        for start, rows in spans:
            embeds[start : start + len(rows)] = rows.to(self.dtype)
        return {"prompt_embeds": embeds, "prompt_token_ids": ids, "prompt_is_token_ids": is_token}


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as templates take it: a call's arguments as an object (the history keeps
    them as the JSON text the model wrote)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):  # left as written, for the template
                function["arguments"] = json.loads(function["arguments"])
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}
