"""Configuration of the stage workers, validated with pydantic (unknown keys are errors)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TINY_CHAT_MODEL = "builtin:tiny-chat"
"""Reasoning model id for the random-weight chat model built locally on first use."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EncoderConfig(Strict):
    """Speech recognition: `pocketsphinx` (offline, model in its wheel) or `whisper`."""

    backend: Literal["pocketsphinx", "whisper"] = "pocketsphinx"
    model: str | None = Field(None, description="whisper: a Hugging Face id or a local folder")
    device: str = "cpu"
    partial_interval_ms: int = Field(600, ge=0, le=10_000)
    options: dict[str, Any] = Field(default_factory=dict, description="backend options")

    @model_validator(mode="after")
    def _whisper_needs_model(self) -> EncoderConfig:
        if self.backend == "whisper" and not self.model:
            raise ValueError("backend 'whisper' needs `model` (a Hugging Face id or a folder)")
        return self


class ReasoningConfig(Strict):
    """The vLLM engine: any chat model vLLM serves; engine_args go to AsyncEngineArgs."""

    model: str = TINY_CHAT_MODEL
    system_prompt: str = (
        "You are a friendly voice assistant. Answer in one or two short spoken sentences."
    )
    engine_args: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] = Field(default_factory=lambda: {"max_tokens": 64})
    max_history_messages: int = Field(40, ge=2)


class VocoderConfig(Strict):
    """Speech synthesis: `espeak` (offline voice in its wheel) or `speecht5` (local weights)."""

    backend: Literal["espeak", "speecht5"] = "espeak"
    voice: str = "en-us"
    model: str | None = Field(None, description="speecht5: acoustic model id or folder")
    vocoder: str | None = Field(None, description="speecht5: HiFi-GAN id or folder")
    speaker_embedding: str | None = Field(None, description="speecht5: .npy of 512 floats")
    device: str = "cpu"
    first_phrase_words: int = Field(
        4,
        ge=1,
        le=50,
        description="start speaking after this many words when no phrase boundary came yet",
    )
    max_phrase_words: int = Field(20, ge=2, le=200)
    max_lead_ms: int = Field(
        2000, ge=100, le=600_000, description="how far synthesis may run ahead of playback"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="backend options")

    @model_validator(mode="after")
    def _speecht5_needs_weights(self) -> VocoderConfig:
        if self.backend == "speecht5" and not (self.model and self.vocoder):
            raise ValueError("backend 'speecht5' needs `model` and `vocoder`")
        return self


class RingsConfig(Strict):
    audio_bytes: int = Field(4 << 20, ge=1 << 16, description="rings that carry audio")
    event_bytes: int = Field(1 << 20, ge=1 << 14, description="rings that carry events")


class SupervisorConfig(Strict):
    ready_timeout_s: float = Field(300.0, gt=0, description="per stage, model loading included")
    max_restarts: int = Field(5, ge=0, description="consecutive failed restarts before giving up")
    stop_timeout_s: float = Field(15.0, gt=0)


class PipelineConfig(Strict):
    """Everything the supervisor needs to run the three stages."""

    max_sessions: int = Field(64, ge=1, le=4096)
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    vocoder: VocoderConfig = Field(default_factory=VocoderConfig)
    rings: RingsConfig = Field(default_factory=RingsConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
