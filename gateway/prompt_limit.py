"""A session's instructions and tools against the reasoning model's context, when they are set.

They are in every prompt of the session: instructions that leave no room for a reply and the
caller's turn would make every reply fail. So a `session.update` (or a call's or a client
secret's session) whose instructions and tools take more tokens than the context holds beside
the reply's cap and a turn is refused, naming the limit in tokens, before anything of it
applies. Refused rather than cut: instructions cut to fit would be a prompt the client never
wrote, and a refusal names the number to write to.

Counted with the model's own tokenizer (its tokenizer.json, read once a process, on the first
check); a model this process cannot read one of (a hub id not on this machine) is not checked,
and a reply that then cannot fit fails in its response.done (docs/realtime.md).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from gateway.fields import ProtocolError
from gateway.protocol import SessionConfig
from stages.config import TINY_CHAT_MODEL, TINY_OMNI, TINY_ULTRAVOX, ReasoningConfig

logger = logging.getLogger(__name__)

# the chat template's own tokens and a caller's turn, beside the instructions and the reply
TURN_TOKENS = 64
DEFAULT_REPLY_TOKENS = 256  # vLLM's prompt budget without a configured max_tokens


class PromptLimit:
    """`check(config)` raises ProtocolError when the session's instructions and tools cannot
    fit the model's context with a reply."""

    def __init__(self, reasoning: ReasoningConfig) -> None:
        self.reasoning = reasoning
        self._lock = threading.Lock()
        self._loaded = False
        self._tokenizer: Any = None
        self.context: int | None = None

    def check(self, config: SessionConfig, param: str = "session") -> None:
        tokenizer, context = self._model()
        if tokenizer is None or context is None:
            return
        tools = config.tools.to_json()
        tokens = len(tokenizer.encode(config.instructions).ids)
        if tools:
            tokens += len(tokenizer.encode(json.dumps(tools)).ids)
        reply = config.token_cap or self.reasoning.sampling.get("max_tokens")
        reply = min(int(reply or DEFAULT_REPLY_TOKENS), context // 2)
        limit = context - reply - TURN_TOKENS
        if tokens > limit:
            raise ProtocolError(
                f"{param}.instructions and tools take {tokens} tokens, and the model's context "
                f"holds {context} (reasoning.engine_args.max_model_len): at most {limit} fit "
                f"beside a reply of {reply} tokens and the caller's turn",
                param=f"{param}.instructions",
                code="context_length_exceeded",
            )

    def _model(self) -> tuple[Any, int | None]:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                try:
                    self._load()
                except Exception as exc:  # unreadable here: left to the reply to fail
                    logger.warning("instructions are not checked against the context: %s", exc)
            return self._tokenizer, self.context

    def _load(self) -> None:
        folder = model_folder(self.reasoning)
        if folder is None:
            logger.info(
                "instructions are not checked against the context: %s is not on this machine",
                self.reasoning.model,
            )
            return
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.context = self.reasoning.engine_args.get("max_model_len") or _positions(folder)


def model_folder(reasoning: ReasoningConfig) -> Path | None:
    """The reasoning model's local folder (its tokenizer's), or None for a hub id: nothing is
    fetched here, on the gateway's event loop."""
    if reasoning.model == TINY_CHAT_MODEL:
        from stages.backends.tiny_chat_model import ensure_tiny_chat_model

        return ensure_tiny_chat_model()  # built by the reasoning stage already
    if reasoning.model == TINY_OMNI:
        from stages.backends.tiny_speech_in import ensure_tiny_omni

        return ensure_tiny_omni()
    if reasoning.model == TINY_ULTRAVOX:
        from stages.backends.tiny_speech_in import ensure_tiny_ultravox

        return ensure_tiny_ultravox()
    from stages.backends import bundled

    path = Path(bundled.resolve(reasoning.model)).expanduser()
    return path if (path / "tokenizer.json").is_file() else None


def _positions(folder: Path) -> int | None:
    """The model's own context (config.json), a speech-in model's language model's."""
    config = json.loads((folder / "config.json").read_text())
    for part in (config.get("thinker_config", {}), config):
        text = part.get("text_config", part)
        if "max_position_embeddings" in text:
            return int(text["max_position_embeddings"])
    return None
