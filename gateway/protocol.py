"""The OpenAI Realtime (GA) session object: what a client may set, checked before anything
changes.

`SessionConfig.apply()` validates a `session.update` (or a client secret's session) as a whole
and only then applies it, so a refused update changes nothing. A value that is wrong by
OpenAI's API (a bad type, an unknown field, a threshold out of range) or that would change what
the client gets in a way it relies on (an audio format, a transcription-only session) is
refused with a `ProtocolError` naming the field. A value OpenAI's API takes that only changes
how the agent sounds or what it could do beside (one of OpenAI's voices, noise reduction, a
speed) is taken without effect, so that it never costs a client the rest of its update (LiveKit
Agents sends `voice: "marin"` with its turn detection and instructions); `session.updated`
shows what is in effect. docs/realtime.md has the table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway import tools
from gateway.config import MAX_OUTPUT_TOKENS, TurnDetectionConfig
from gateway.fields import ProtocolError, check_keys, mapping, text_field, unsupported
from gateway.opus import OpusUnavailable, opuslib
from gateway.tools import ToolSet
from stages.messages import CALLER_RATE

INPUT_RATE = 24_000  # audio/pcm in the Realtime API: PCM16 mono 24 kHz, little-endian
# audio/pcm in at 16 kHz too (an extension, as SGLang-Omni takes it: NVIDIA's Full-Duplex-Bench
# client asks for it); the caller's audio is that rate in the pipeline, so nothing resamples
PCM_INPUT_RATES = (INPUT_RATE, CALLER_RATE)
OUTPUT_RATE = 24_000
OPUS = "audio/opus"
OPUS_RATE = 24_000  # what the agent's audio/opus is coded at
G711_FORMATS = ("audio/pcmu", "audio/pcma")  # 8 kHz telephone audio (gateway.g711)
G711_RATE = 8_000
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


#: the voices of OpenAI's Realtime API; any of them is taken, and the vocoder's voice speaks
OPENAI_VOICES = frozenset(
    ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
)

SERVER_VAD_FIELDS = (
    "threshold",
    "prefix_padding_ms",
    "silence_duration_ms",
    "create_response",
    "interrupt_response",
    "idle_timeout_ms",
)
SEMANTIC_VAD_FIELDS = ("eagerness", "create_response", "interrupt_response")


@dataclass
class TurnDetection:
    """OpenAI's server_vad or semantic_vad; None in SessionConfig means manual turns (commit).
    Fields of the other type keep their values, unused, for a switch back."""

    type: str = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: str = "auto"
    idle_timeout_ms: int | None = None

    @property
    def semantic(self) -> bool:
        return self.type == "semantic_vad"

    def to_json(self) -> dict[str, Any]:
        names = SEMANTIC_VAD_FIELDS if self.semantic else SERVER_VAD_FIELDS
        return {"type": self.type, **{name: getattr(self, name) for name in names}}

    @classmethod
    def parse(cls, value: Any, current: TurnDetection | None, param: str) -> TurnDetection | None:
        if value is None:
            return None
        value = mapping(value, param)
        kind = value.get("type", "server_vad")
        if kind not in ("server_vad", "semantic_vad"):
            raise ProtocolError(
                f"{param}.type must be 'server_vad' or 'semantic_vad', not {kind!r}",
                param=f"{param}.type",
            )
        fields = SEMANTIC_VAD_FIELDS if kind == "semantic_vad" else SERVER_VAD_FIELDS
        check_keys(value, {"type", *fields}, param)
        merged = {**vars(current or cls()), **value, "type": kind}
        try:
            checked = TurnDetectionConfig.model_validate(merged)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = f"{param}." + ".".join(str(p) for p in first["loc"])
            raise ProtocolError(f"{where}: {first['msg']}", param=where) from None
        return cls(**checked.model_dump())


def _audio_format(
    value: Any, param: str, pcm_rates: tuple[int, ...] = (INPUT_RATE,)
) -> tuple[str, int]:
    """(type, rate) of an audio format object; `pcm_rates`: the rates audio/pcm may have."""
    value = mapping(value, param)
    kind = value.get("type")
    if kind == "audio/pcm":
        rate = value.get("rate", INPUT_RATE)
        if rate not in pcm_rates:
            hz = " or ".join(str(r) for r in pcm_rates)
            raise unsupported(f"{param}.rate={rate}", f"audio/pcm is {hz} Hz")
        return kind, rate
    if kind == OPUS:
        # an extension: one 20 ms Opus packet per event, base64 (docs/realtime.md); Opus
        # decodes any coded rate, so `rate` is only a description
        rate = value.get("rate", OPUS_RATE)
        if rate not in (8000, 12000, 16000, 24000, 48000):
            raise unsupported(f"{param}.rate={rate}", "Opus rates are 8, 12, 16, 24, 48 kHz")
        try:
            opuslib()
        except OpusUnavailable as exc:
            raise unsupported(f"{param}.type='audio/opus'", str(exc)) from None
        return kind, OPUS_RATE
    if kind in G711_FORMATS:
        rate = value.get("rate", G711_RATE)
        if rate != G711_RATE:
            raise unsupported(f"{param}.rate={rate}", "G.711 is 8000 Hz")
        return kind, G711_RATE
    raise ProtocolError(
        f"{param}.type must be 'audio/pcm', 'audio/pcmu', 'audio/pcma' or 'audio/opus', "
        f"not {kind!r}",
        param=f"{param}.type",
    )


NOISE_REDUCTIONS = ("near_field", "far_field")


def _noise_reduction(value: Any, param: str) -> str | None:
    """`{"type": "near_field" | "far_field"}`, or null for the transport's default."""
    if value is None:
        return None
    value = mapping(value, param)
    check_keys(value, {"type"}, param)
    kind = value.get("type")
    if kind not in NOISE_REDUCTIONS:
        raise ProtocolError(
            f"{param}.type must be one of {', '.join(NOISE_REDUCTIONS)}, not {kind!r}",
            param=f"{param}.type",
        )
    return str(kind)


def format_json(kind: str, rate: int) -> dict[str, Any]:
    return {"type": kind, "rate": rate}


def _modalities(value: Any, param: str) -> list[str]:
    if value not in (["audio"], ["text"]):
        raise ProtocolError(f"{param} must be ['audio'] or ['text'], not {value!r}", param=param)
    return list(value)


def _max_tokens(value: Any, param: str) -> int | str:
    if value == "inf":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise ProtocolError(
            f"{param} must be 'inf' or an integer from 1 to {MAX_OUTPUT_TOKENS}", param=param
        )
    return value


def _metadata(value: Any) -> dict[str, Any]:
    value = mapping(value, "response.metadata")
    if len(value) > METADATA_KEYS:
        raise ProtocolError(
            f"response.metadata has more than {METADATA_KEYS} keys", param="response.metadata"
        )
    for key, item in value.items():
        param = f"response.metadata.{key[:METADATA_KEY_CHARS]}"
        if len(key) > METADATA_KEY_CHARS:
            raise ProtocolError(
                f"response.metadata keys are at most {METADATA_KEY_CHARS} characters", param=param
            )
        if not isinstance(item, str) or len(item) > METADATA_VALUE_CHARS:
            raise ProtocolError(
                f"response.metadata values are strings of at most {METADATA_VALUE_CHARS} "
                "characters",
                param=param,
            )
    return value


def _tracing(value: Any, param: str) -> str | dict[str, Any] | None:
    """OpenAI's session tracing: null, "auto", or {workflow_name, group_id, metadata}. The
    gateway's traces go where gateway.tracing says (docs/tracing.md); the names become
    attributes of each turn's trace."""
    if value is None or value == "auto":
        return value
    value = mapping(value, param)
    check_keys(value, {"workflow_name", "group_id", "metadata"}, param)
    for key in ("workflow_name", "group_id"):
        if key in value and not (isinstance(value[key], str) and len(value[key]) <= 256):
            raise ProtocolError(
                f"{param}.{key} must be a string of at most 256 characters", param=f"{param}.{key}"
            )
    if "metadata" in value:
        mapping(value["metadata"], f"{param}.metadata")
    return copy.deepcopy(value)


@dataclass
class SessionConfig:
    """One session's settings, rendered as the GA `session` object."""

    voice: str  # the vocoder's voice: it speaks whichever of OpenAI's voices a client names
    model: str = "omni-gateway"
    instructions: str = ""
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription: dict[str, Any] | None = field(default_factory=lambda: {"model": "server"})
    max_output_tokens: int | str = "inf"
    tracing: str | dict[str, Any] | None = None  # "auto", or {workflow_name, group_id, metadata}
    input_format: str = "audio/pcm"
    input_rate: int = INPUT_RATE
    output_format: str = "audio/pcm"
    output_rate: int = OUTPUT_RATE
    tools: ToolSet = field(default_factory=ToolSet)
    # the gateway's own events (omni.*) beside OpenAI's: off unless the client asks, since
    # clients that refuse event types they do not know stop at the first (docs/realtime.md)
    omni_events: bool = False
    # audio.input.noise_reduction's type: "far_field" (a speakerphone: the agent's echo
    # cancelled, the noise suppressed), "near_field" (a headset: the noise suppressed), or
    # None for the transport's default (gateway.media.echo_cancel; gateway.echo)
    noise_reduction: str | None = None

    @property
    def audio_out(self) -> bool:
        return self.output_modalities == ["audio"]

    @property
    def token_cap(self) -> int | None:
        return None if self.max_output_tokens == "inf" else int(self.max_output_tokens)

    def apply(self, update: Any, param: str = "session") -> None:
        """Validate a whole session object, then apply it; a ProtocolError changes nothing."""
        new = self.updated(update, param)
        self.__dict__.update(new.__dict__)

    def updated(self, update: Any, param: str = "session") -> SessionConfig:
        update = mapping(update, param)
        check_keys(
            update,
            {
                "type",
                "id",
                "object",
                "model",
                "instructions",
                "output_modalities",
                "audio",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "max_output_tokens",
                "tracing",
                "truncation",
                "include",
                "prompt",
                "expires_at",
                "omni_events",
            },
            param,
        )
        new = copy.deepcopy(self)
        if update.get("type", "realtime") != "realtime":
            raise unsupported(f"{param}.type={update['type']!r}", "transcription sessions")
        if "model" in update:
            if not isinstance(update["model"], str):
                raise ProtocolError(f"{param}.model must be a string", param=f"{param}.model")
            new.model = update["model"]
        if "instructions" in update:
            new.instructions = text_field(update["instructions"], f"{param}.instructions")
        if "omni_events" in update:
            if not isinstance(update["omni_events"], bool):
                raise ProtocolError(
                    f"{param}.omni_events must be true or false", param=f"{param}.omni_events"
                )
            new.omni_events = update["omni_events"]
        if "output_modalities" in update:
            new.output_modalities = _modalities(
                update["output_modalities"], f"{param}.output_modalities"
            )
        if "max_output_tokens" in update:
            new.max_output_tokens = _max_tokens(
                update["max_output_tokens"], f"{param}.max_output_tokens"
            )
        new.tools = tools.updated(self.tools, update, param)
        if "tracing" in update:
            new.tracing = _tracing(update["tracing"], f"{param}.tracing")
        # truncation other than auto, include (transcription logprobs): taken, not honoured:
        # the history is fitted to the model's context, and no logprobs are made
        if update.get("prompt") is not None:
            raise unsupported(f"{param}.prompt", "no stored prompts; use instructions")
        if "audio" in update:
            new._apply_audio(mapping(update["audio"], f"{param}.audio"), f"{param}.audio")
        return new

    def _apply_audio(self, audio: dict[str, Any], param: str) -> None:
        check_keys(audio, {"input", "output"}, param)
        inp = mapping(audio.get("input", {}), f"{param}.input")
        check_keys(
            inp, {"format", "transcription", "noise_reduction", "turn_detection"}, f"{param}.input"
        )
        if "format" in inp:
            self.input_format, self.input_rate = _audio_format(
                inp["format"], f"{param}.input.format", PCM_INPUT_RATES
            )
        if "noise_reduction" in inp:
            self.noise_reduction = _noise_reduction(
                inp["noise_reduction"], f"{param}.input.noise_reduction"
            )
        if "transcription" in inp:
            t = inp["transcription"]
            if t is not None:
                t = mapping(t, f"{param}.input.transcription")
                check_keys(t, {"model", "language", "prompt"}, f"{param}.input.transcription")
            self.transcription = t
        if "turn_detection" in inp:
            self.turn_detection = TurnDetection.parse(
                inp["turn_detection"], self.turn_detection, f"{param}.input.turn_detection"
            )
        out = mapping(audio.get("output", {}), f"{param}.output")
        check_keys(out, {"format", "voice", "speed"}, f"{param}.output")
        if "format" in out:
            self.output_format, self.output_rate = _audio_format(
                out["format"], f"{param}.output.format"
            )
        voice = out.get("voice", self.voice)
        if voice != self.voice and voice not in OPENAI_VOICES:
            raise unsupported(
                f"{param}.output.voice={voice!r}",
                f"this gateway's vocoder speaks with voice {self.voice!r} (OpenAI's voice names "
                "are taken, and it speaks them)",
            )
        speed = out.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)):
            raise ProtocolError(
                f"{param}.output.speed must be a number", param=f"{param}.output.speed"
            )
        # another speed is taken, not honoured: the vocoder speaks at 1.0

    def to_json(self, session_id: str, expires_at: int = 0) -> dict[str, Any]:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": format_json(self.input_format, self.input_rate),
                    "transcription": self.transcription,
                    "noise_reduction": (
                        {"type": self.noise_reduction} if self.noise_reduction else None
                    ),
                    "turn_detection": (
                        self.turn_detection.to_json() if self.turn_detection else None
                    ),
                },
                "output": {
                    "format": format_json(self.output_format, self.output_rate),
                    "voice": self.voice,
                    "speed": 1.0,
                },
            },
            "tools": self.tools.to_json(),
            "tool_choice": self.tools.choice.to_json(),
            "parallel_tool_calls": self.tools.parallel,
            "max_output_tokens": self.max_output_tokens,
            "tracing": self.tracing,
            "truncation": "auto",
            "prompt": None,
            "include": None,
            "expires_at": expires_at,
        }


@dataclass(frozen=True)
class ResponseParams:
    """The parts of response.create's `response` that this gateway carries out."""

    instructions: str | None = None
    audio: bool | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, Any] | None = None
    tools: ToolSet | None = None  # None: the session's


def parse_response_create(value: Any, session: SessionConfig) -> ResponseParams:
    if value is None:
        return ResponseParams()
    value = mapping(value, "response")
    check_keys(
        value,
        {
            "instructions",
            "output_modalities",
            "max_output_tokens",
            "metadata",
            "conversation",
            "input",
            "audio",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "prompt",
        },
        "response",
    )
    if value.get("conversation", "auto") != "auto":
        raise unsupported(
            "response.conversation", "out-of-band responses are not built; replies join it"
        )
    if value.get("input") is not None:
        raise unsupported("response.input", "add items with conversation.item.create")
    if value.get("prompt") is not None:
        raise unsupported("response.prompt", "no stored prompts; use instructions")
    reply_tools = None
    if {"tools", "tool_choice", "parallel_tool_calls"} & value.keys():
        # MCP servers are the session's: their tools are listed as it is updated
        reply_tools = tools.updated(session.tools, value, "response", allow_mcp=False)
    if "audio" in value:
        # the same checks as session.audio.output, without changing the session
        audio = mapping(value["audio"], "response.audio")
        check_keys(audio, {"output"}, "response.audio")
        session.updated({"audio": {"output": audio.get("output", {})}}, "response")
    metadata = value.get("metadata")
    if metadata is not None:
        metadata = _metadata(metadata)
    tokens = value.get("max_output_tokens")
    if tokens is not None:
        tokens = _max_tokens(tokens, "response.max_output_tokens")
    modalities = value.get("output_modalities")
    return ResponseParams(
        # null is absent, as in OpenAI's API (LiveKit Agents sends `instructions: null`)
        instructions=(
            text_field(value["instructions"], "response.instructions")
            if value.get("instructions") is not None
            else None
        ),
        audio=(
            None
            if modalities is None
            else _modalities(modalities, "response.output_modalities") == ["audio"]
        ),
        max_output_tokens=None if tokens in (None, "inf") else int(tokens),
        metadata=metadata,
        tools=reply_tools,
    )
