"""The YAML configuration of `omni-gateway start`: the pipeline's stages plus the gateway."""

from __future__ import annotations

import ipaddress
import urllib.parse
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from stages.config import ClusterConfig, EncoderConfig, PipelineConfig, Strict

MAX_OUTPUT_TOKENS = 4096  # a reply's cap in the Realtime API's max_output_tokens


class TurnDetectionConfig(Strict):
    """A new session's turn detection (OpenAI's `audio.input.turn_detection`, which
    session.update changes). `server_vad` ends a turn after `silence_duration_ms` of silence;
    `semantic_vad` asks the end-of-turn models once the caller pauses (`end_of_turn`)."""

    type: Literal["server_vad", "semantic_vad"] = Field(
        "server_vad", description="server_vad: a silence window; semantic_vad: on meaning"
    )
    threshold: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="how clearly a frame must be speech: webrtcvad's mode by quarters, or "
        "Silero's probability",
    )
    prefix_padding_ms: int = Field(
        300, ge=0, le=2000, description="audio before the detected start that the turn keeps"
    )
    silence_duration_ms: int = Field(
        500, ge=20, le=5000, description="silence after the last speech that ends a turn"
    )
    create_response: bool = Field(True, description="a turn that ends is answered")
    interrupt_response: bool = Field(True, description="the caller's speech stops the agent")
    eagerness: Literal["low", "medium", "high", "auto"] = Field(
        "auto",
        description="semantic_vad: how soon a turn ends; a turn that sounds cut off waits up "
        "to 8 s (low), 4 s (medium) or 2 s (high); auto is medium",
    )
    idle_timeout_ms: int | None = Field(
        None,
        ge=1000,
        le=600_000,
        description="server_vad: no audio from the caller this long after the agent's reply "
        "was heard commits an empty turn and answers it (input_audio_buffer.timeout_triggered)",
    )


class VadConfig(Strict):
    """The per-frame speech classifier under the turn detector."""

    classifier: Literal["webrtc", "silero"] = Field(
        "webrtc", description="webrtcvad, or Silero VAD on ONNX (`silero_model`)"
    )
    silero_model: str = Field(
        "bundled:silero-vad", description="Silero's ONNX model: a folder, a file or bundled:NAME"
    )


class EndOfTurnConfig(Strict):
    """semantic_vad's models: one on the sound of the turn (in each gateway process) and one on
    its words (in the encoder stage, on the encoder's device)."""

    model: str = Field(
        "bundled:smart-turn-v3.2",
        description="the sound model (Smart Turn v3): a folder holding model.onnx, or a file",
    )
    words_model: str | None = Field(
        "bundled:smollm2-135m-instruct",
        description="a small chat model (a Hugging Face id, a local folder, or bundled:NAME) "
        "that judges at the caller's pause whether their words so far end the turn "
        "(stages.backends.words_end_turn); null: the sound alone decides",
    )
    ask_after_ms: int = Field(
        200,
        ge=20,
        le=2000,
        description="the caller's silence after which the models are asked whether the turn "
        "is over",
    )
    sure: float = Field(
        0.95,
        ge=0.5,
        le=1.0,
        description="the sound model's probability from which the turn ends without waiting "
        "for the words (1.0: always wait); words that came first still decide",
    )


BACKCHANNELS = [
    "mm hmm",
    "uh huh",
    "yeah",
    "yep",
    "yes",
    "ok",
    "okay",
    "right",
    "sure",
    "alright",
    "i see",
    "got it",
]


class InterruptionsConfig(Strict):
    """What the caller's voice over the agent does (with detection.interrupt_response).

    `immediate`: the agent stops at the first voiced frames, and the reply is cancelled in
    every stage once the VAD calls it speech (60 ms in). `provisional`: the agent is paused at
    the same moment, its audio held where it stopped, and the reply goes on being made; once
    the caller's sound ends, its transcript decides: no words, or only backchannels, and the
    agent resumes where it paused; words that count, and the reply is cut there and the
    caller's words answered. Speech that goes on for `confirm_ms` is an interruption without
    waiting for its words. Only a transport that plays the agent's audio out itself (WebRTC,
    the phone) can pause it; a WebSocket session's are immediate."""

    policy: Literal["immediate", "provisional"] = Field(
        "provisional", description="immediate: any speech cuts; provisional: words decide"
    )
    hold_on_voice: bool = Field(
        True,
        description="silence the agent from the caller's first voiced frame until the VAD "
        "decides (onset, 60 ms later) whether they are talking over it: a barge-in is heard to "
        "stop that much sooner; a false start costs a moment of silence, nothing is dropped",
    )
    backchannels: list[str] = Field(
        default_factory=lambda: list(BACKCHANNELS),
        description="words that do not interrupt on their own (hums such as mm, hmm, uh are "
        "never words that count)",
    )
    min_speech_ms: int = Field(
        600,
        ge=0,
        le=5000,
        description="voiced time a provisional turn needs to interrupt, whatever its words: "
        "a recognizer hears words in a hum now and then (LiveKit's default is 500)",
    )
    confirm_ms: int = Field(
        1000, ge=100, le=5000, description="voiced time over the agent that interrupts"
    )


class TurnsConfig(Strict):
    """Turn-taking: detection, the classifier, semantic_vad's models, interruptions, and the
    reply made at the caller's pause."""

    detection: TurnDetectionConfig = Field(default_factory=TurnDetectionConfig)
    vad: VadConfig = Field(default_factory=VadConfig)
    end_of_turn: EndOfTurnConfig = Field(default_factory=EndOfTurnConfig)
    interruptions: InterruptionsConfig = Field(default_factory=InterruptionsConfig)
    prepare_reply_ms: int = Field(
        150,
        ge=0,
        le=5000,
        description="silence inside a turn after which the stages start on the reply (final "
        "transcript, first tokens) while the VAD waits out the silence window; held back until "
        "the turn ends, dropped if the caller goes on. 0: off; only values under "
        "silence_duration_ms do anything",
    )


class AuthConfig(Strict):
    """Who may use the gateway: `Authorization: Bearer <key>` with a configured API key, or an
    ephemeral `ek_` key minted by POST /v1/realtime/client_secrets."""

    enabled: bool = Field(
        True, description="false: anyone who reaches the port may call (local use only)"
    )
    api_keys: list[str] = Field(default_factory=list, description="accepted API keys")
    api_keys_env: str | None = Field(
        "OMNI_GATEWAY_API_KEYS",
        description="environment variable with more keys, comma-separated (keeps them out of "
        "the YAML)",
    )
    client_secret_ttl_s: int = Field(
        600, ge=10, le=7200, description="lifetime of a client secret when the request names none"
    )
    allow_off_on_network: bool = Field(
        False,
        description="with auth off, serve on an address other than loopback anyway (refused "
        "at start otherwise: anyone on the network could call)",
    )


class LimitsConfig(Strict):
    """Bounds on what one client can hold or start, each process on its own (a service of
    several gateway processes allows that many times each count)."""

    connect_timeout_s: float = Field(
        15.0,
        gt=0,
        le=300,
        description="a WebRTC call whose ICE has not connected this long after its answer is "
        "closed, and its slot freed",
    )
    first_event_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="a WebSocket session that sends no event this long after it opens is "
        "closed; null: never",
    )
    request_timeout_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="an HTTP request's headers, and its body, must come within this; an idle "
        "kept-alive connection is closed after it too",
    )
    calls_per_key: int | None = Field(
        None, ge=1, description="calls one API key may hold at once; null: any number"
    )
    calls_per_client_secret: int | None = Field(
        2, ge=1, description="calls one ek_ client secret may hold at once; null: any number"
    )
    calls_per_address: int | None = Field(
        None, ge=1, description="calls one client address may hold at once; null: any number"
    )
    new_calls_per_address_per_minute: int | None = Field(
        120,
        ge=1,
        description="new calls and sessions one client address may open a minute; null: any",
    )
    auth_failures_per_address_per_minute: int | None = Field(
        30,
        ge=1,
        description="wrong or missing keys one address may present a minute; past it every "
        "request of that address gets 429 until the minute is over (keys cannot be guessed "
        "at speed); null: no bound",
    )


class CorsConfig(Strict):
    """Pages on other origins that may call the Realtime HTTP endpoints (POST
    /v1/realtime/calls, its hang-ups, POST /v1/realtime/client_secrets) from a browser:
    the OpenAI Agents SDK's WebRTC transport served from another site, say. Pages the gateway
    serves itself (the demo page) need none of this."""

    allowed_origins: list[str] = Field(
        default_factory=list,
        description='origins as browsers send them ("https://app.example.com", '
        '"http://127.0.0.1:5173"); ["*"]: any origin; []: none',
    )
    max_age_s: int = Field(
        600, ge=0, le=86400, description="how long a browser may reuse a preflight's answer"
    )

    @field_validator("allowed_origins")
    @classmethod
    def _valid_origins(cls, origins: list[str]) -> list[str]:
        if "*" in origins and len(origins) > 1:
            raise ValueError('"*" allows every origin: list it alone')
        origins = [o.lower() for o in origins]  # as browsers write them
        for origin in origins:
            if origin == "*":
                continue
            scheme, sep, host = origin.partition("://")
            # an origin is scheme://host[:port]; browsers never send a path or a slash after it
            if not sep or scheme not in ("http", "https") or not host or "/" in host:
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port], with no path "
                    "and no trailing slash"
                )
        return origins


class MetricsConfig(Strict):
    """Who may scrape GET /metrics: whoever reaches the port, unless a token is set."""

    token_env: str | None = Field(
        None,
        description="environment variable holding a token that scrapes must send as "
        "'Authorization: Bearer <token>' (Prometheus' `authorization` setting); the gateway "
        "refuses to start when it is named but unset. Unset: /metrics needs no token",
    )


class TracingConfig(Strict):
    """OpenTelemetry traces of each turn and each cancel, sent over OTLP/HTTP to a collector,
    Langfuse or Arize Phoenix (gateway.tracing, docs/tracing.md). Off unless `otlp_endpoint`
    is set; off, nothing of OpenTelemetry is even imported."""

    otlp_endpoint: str | None = Field(
        None,
        description="the OTLP/HTTP (protobuf) traces URL, whole: "
        "http://127.0.0.1:4318/v1/traces for a collector, http://HOST:6006/v1/traces for "
        "Phoenix, https://HOST/api/public/otel/v1/traces for Langfuse; null: no traces",
    )
    service_name: str = Field("omni-gateway", description="the traces' service.name")
    headers_env: str | None = Field(
        None,
        description="environment variable holding the export's headers as k=v,k=v with "
        "URL-encoded values (OTEL_EXPORTER_OTLP_HEADERS' format), such as Langfuse's "
        "'Authorization=Basic%20<base64 of pk:sk>': secrets stay out of the YAML. The gateway "
        "refuses to start when it is named but unset",
    )
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="the share of turns and cancels traced (by trace id)"
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{url!r} is not an OTLP/HTTP URL: write http(s)://host:port/v1/traces"
            )
        return url


class ToolsConfig(Strict):
    """Function and MCP tools (the Realtime API's `tools`, docs/realtime.md "Tools")."""

    mcp_servers: list[str] = Field(
        default_factory=list,
        description="the MCP servers sessions may name, as scheme://host[:port][/path] "
        '("https://tools.example.com/mcp", "http://127.0.0.1"): a server_url matches with '
        "the same scheme and host, the same port if one is given (any port if not), and a "
        "path under the given one. The gateway connects to them on the caller's behalf, so "
        'list only servers callers may reach; ["*"]: any URL; []: MCP tools refused',
    )
    mcp_list_timeout_s: float = Field(
        10.0, gt=0, le=120, description="connecting to an MCP server and listing its tools"
    )
    mcp_call_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="one MCP tool call; past it the call fails and the model is told so",
    )
    function_output_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="how long after a reply that called a function the client has to send "
        "its function_call_output before an `error` event says it never came; null: no limit",
    )

    @field_validator("mcp_servers")
    @classmethod
    def _valid_prefixes(cls, prefixes: list[str]) -> list[str]:
        if "*" in prefixes and len(prefixes) > 1:
            raise ValueError('"*" allows every URL: list it alone')
        for prefix in prefixes:
            if prefix == "*":
                continue
            parts = urllib.parse.urlsplit(prefix)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
                raise ValueError(f"{prefix!r} is not an http(s) URL: scheme://host[:port][/path]")
        return prefixes

    def mcp_allowed(self, url: str) -> bool:
        """Whether a session may have the gateway connect to the MCP server at `url`."""
        if "*" in self.mcp_servers:
            return True
        try:
            got = urllib.parse.urlsplit(url)
            port = got.port
        except ValueError:
            return False
        for prefix in self.mcp_servers:
            want = urllib.parse.urlsplit(prefix)
            if (
                got.scheme == want.scheme
                and got.hostname == want.hostname
                and (want.port is None or port == want.port)
                and got.path.startswith(want.path)
                and not got.username
            ):
                return True
        return False


class TelephonyConfig(Strict):
    """Phone calls through Twilio Media Streams: a TwiML `<Connect><Stream>` pointed at
    `wss://HOST/v1/telephony/twilio` (docs/telephony.md)."""

    twilio: bool = Field(True, description="serve /v1/telephony/twilio")
    key_parameter: str = Field(
        "api_key",
        description="the stream's custom parameter (TwiML <Parameter>) that carries an API "
        "key, when gateway.auth is on; the URL's ?api_key= is read too",
    )
    profile_parameter: str = Field(
        "profile", description="the custom parameter that names one of `profiles`"
    )
    profiles: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="named session settings (Realtime session objects: instructions, "
        "turn_detection, tools, ...) a call chooses by its profile parameter; `default`, if "
        "there is one, is for calls that name none",
    )
    start_timeout_s: float = Field(
        10.0, gt=0, le=120, description="how long the stream may take to send its `start`"
    )
    send_ahead_ms: int = Field(
        200,
        ge=40,
        le=5000,
        description="agent audio sent ahead of what the caller has heard: what still plays "
        "after a pause, and what a slow network may take",
    )


class EchoCancelConfig(Strict):
    """The caller's audio through WebRTC's echo canceller (AEC3), noise suppressor and
    high-pass filter before the VAD hears it (gateway.echo): for a caller on a speakerphone
    or a car kit, whose microphone hears the agent. On by default for phone calls, which have
    no canceller on the gateway's side of the line; browsers cancel their own echo. A session's
    `audio.input.noise_reduction` overrides its transport's default: `far_field` turns it on,
    `near_field` keeps only the noise suppressor (docs/realtime.md)."""

    phone: bool = Field(True, description="phone calls (Twilio Media Streams)")
    webrtc: bool = Field(
        False, description="WebRTC calls (a browser's own echo canceller is on by default)"
    )
    websocket: bool = Field(
        False,
        description="Realtime WebSocket sessions: the caller's audio must come as it is "
        "spoken (a live microphone), since the echo is found by the time it arrives",
    )
    noise_suppression: bool = Field(
        True, description="WebRTC's noise suppressor beside the canceller, where it is on"
    )


class MediaConfig(Strict):
    """How a gateway process carries its calls' audio: aiortc's jitter buffer and sockets, and
    the event loop that every call on the process shares."""

    audio_prefetch: int = Field(
        0,
        ge=0,
        le=16,
        description="20 ms frames of caller audio the jitter buffer holds before it hands "
        "one on: 0 hands each on as it arrives, in order; aiortc holds 4 (~80 ms), and even "
        "at 0 one (it waits for the next packet to know a frame is whole)",
    )
    udp_reads_per_wake: int = Field(
        32,
        ge=1,
        le=1024,
        description="queued datagrams an ICE socket reads each time the event loop wakes it: "
        "asyncio reads 1, and a busy loop then falls behind 50 packets a second (media and "
        "ICE consent wait; calls drop after 30 s)",
    )
    gc_freeze: bool = Field(
        True,
        description="exempt what exists when the gateway starts serving (imports, config, "
        "app: ~80k objects) from garbage collection, so a full collection, which holds "
        "every call's audio, scans only what the calls allocate",
    )
    stall_report_ms: int | None = Field(
        None,
        ge=5,
        description="when set, log the event loop's stack each time it is held this long "
        "(every call's audio waits while it is): what to fix, caught in the act",
    )
    echo_cancel: EchoCancelConfig = Field(
        default_factory=EchoCancelConfig,
        description="the agent's echo taken out of the caller's audio, by transport",
    )


class GatewayConfig(Strict):
    host: str = Field("127.0.0.1", description="the address to serve on")
    port: int = Field(8080, ge=0, le=65535, description="the port (0: any free one)")
    max_calls: int = Field(
        32,
        ge=1,
        description="calls the whole service takes (split evenly over the processes); "
        "beyond it, new calls get 503 + Retry-After",
    )
    processes: int = Field(
        1,
        ge=1,
        le=64,
        description="gateway processes sharing the port (SO_REUSEPORT) and the stage workers; "
        "one core's worth of calls each",
    )
    ice_servers: list[str] = Field(default_factory=list, description="stun:/turn: URLs")
    ice_host_addresses: list[str] | None = Field(
        None,
        description="offer only these host candidates (e.g. [127.0.0.1]); default: all "
        "interfaces but loopback, as aioice does",
    )
    trace_dir: str | None = Field(
        None,
        description="write every stage record each gateway process receives (audio without its "
        "samples), stamped with when it arrived, to TRACE_DIR/<process>.trace: for latency "
        "analysis (gateway.trace; loadtest.gpu_run reads them). Off by default",
    )
    max_output_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_OUTPUT_TOKENS,
        description="a new session's max_output_tokens (session.update and response.create "
        "change it); unset: 'inf', each reply capped by reasoning.sampling.max_tokens",
    )
    turns: TurnsConfig = Field(default_factory=TurnsConfig)
    media: MediaConfig = Field(default_factory=MediaConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    cors: CorsConfig = Field(default_factory=CorsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    telephony: TelephonyConfig = Field(default_factory=TelephonyConfig)

    @model_validator(mode="after")
    def _no_open_door(self) -> GatewayConfig:
        if (
            not self.auth.enabled
            and not self.auth.allow_off_on_network
            and not is_loopback(self.host)
        ):
            raise ValueError(
                f"gateway.auth.enabled is false and gateway.host is {self.host!r}, which is not "
                "a loopback address: anyone on the network could call. Turn auth on (with "
                "gateway.auth.api_keys), serve on 127.0.0.1, or set "
                "gateway.auth.allow_off_on_network: true on purpose"
            )
        return self


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; a name or 0.0.0.0 is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OmniConfig(PipelineConfig):
    """A whole deployment, as written in configs/*.yaml."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    cluster: ClusterConfig | None = Field(
        None, description="stages placed on other hosts by Ray; unset: every stage here"
    )

    @model_validator(mode="before")
    @classmethod
    def _words_model_to_the_encoder(cls, data: Any) -> Any:
        """semantic_vad's words model is a gateway.turns key that the encoder stage loads: the
        stages, which see only their own sections, are given it as encoder.end_of_turn_words."""
        if not isinstance(data, dict):
            return data
        words = _words_model(data.get("gateway"))
        encoder = data.get("encoder")
        if isinstance(encoder, EncoderConfig):
            encoder = encoder.model_copy(update={"end_of_turn_words": words})
        elif isinstance(encoder, dict) or encoder is None:
            encoder = {**(encoder or {}), "end_of_turn_words": words}
        return {**data, "encoder": encoder}

    @model_validator(mode="after")
    def _sessions_for_every_process(self) -> OmniConfig:
        if self.max_sessions < self.gateway.processes:
            raise ValueError(
                f"max_sessions ({self.max_sessions}) is less than gateway.processes "
                f"({self.gateway.processes}): every process needs session ids"
            )
        return self

    @property
    def max_calls_per_process(self) -> int:
        """Each gateway process's share of gateway.max_calls (rounded up)."""
        return -(-self.gateway.max_calls // self.gateway.processes)


def _words_model(gateway: Any) -> str | None:
    """gateway.turns.end_of_turn.words_model as given (a model or its dict), or its default."""
    if isinstance(gateway, GatewayConfig):
        return gateway.turns.end_of_turn.words_model
    default = EndOfTurnConfig.model_fields["words_model"].default
    node: Any = gateway
    for key in ("turns", "end_of_turn"):
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, (TurnsConfig, EndOfTurnConfig, GatewayConfig)):
            node = getattr(node, key)
        else:
            return default
    if isinstance(node, EndOfTurnConfig):
        return node.words_model
    if isinstance(node, dict):
        return node.get("words_model", default)
    return default


# Keys of earlier configurations, and where each lives now: a file that still uses one is
# refused, naming the new key, rather than have its setting silently dropped or defaulted.
_EXPERIMENT = " (a benchmark's override, not a configuration file's)"
MOVED_KEYS = {
    "gateway.turn_detection": "gateway.turns.detection",
    "gateway.interruptions": "gateway.turns.interruptions",
    "gateway.voice_activity": "gateway.turns.vad.classifier",
    "gateway.silero_model": "gateway.turns.vad.silero_model",
    "gateway.end_of_turn": "gateway.turns.end_of_turn.model",
    "gateway.end_of_turn_pause_ms": "gateway.turns.end_of_turn.ask_after_ms",
    "gateway.end_of_turn_sure": "gateway.turns.end_of_turn.sure",
    "gateway.barge_in_hold": "gateway.turns.interruptions.hold_on_voice",
    "gateway.prepare_reply_ms": "gateway.turns.prepare_reply_ms",
    "encoder.end_of_turn_words": "gateway.turns.end_of_turn.words_model",
    "gateway.audio_prefetch": "gateway.media.audio_prefetch",
    "gateway.udp_reads_per_wake": "gateway.media.udp_reads_per_wake",
    "gateway.gc_freeze": "gateway.media.gc_freeze",
    "gateway.stall_report_ms": "gateway.media.stall_report_ms",
    "gateway.opus": "experiments.opus" + _EXPERIMENT,
    "gateway.audio_decode": "experiments.audio_decode" + _EXPERIMENT,
    "rings.wake_yield": "experiments.wake_yield" + _EXPERIMENT,
    "mps_thread_percent": "experiments.mps_thread_percent" + _EXPERIMENT,
}


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and the key."""


def _format(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    return f"{path}: {err['msg']}"


def parse_config(data: Any, source: str = "config") -> OmniConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, not {type(data).__name__}")
    if moved := [f"  {old}: moved to {new}" for old, new in MOVED_KEYS.items() if _has(data, old)]:
        lines = "\n".join(moved)
        raise ConfigError(f"{source}: keys of an earlier configuration:\n{lines}")
    try:
        return OmniConfig.model_validate(data)
    except ValidationError as exc:
        lines = "\n".join(f"  {_format(e)}" for e in exc.errors())
        raise ConfigError(f"{source}: invalid configuration:\n{lines}") from None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> OmniConfig:
    """Read and validate a YAML file; `overrides` ({"gateway.port": 9000}) win over it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if isinstance(data, dict) and "experiments" in data:
        raise ConfigError(
            f"{path}: experiments: the benchmarks' comparisons, not a configuration's: they "
            "are set as overrides only (load_config's, a benchmark's --set)"
        )
    for dotted, value in (overrides or {}).items():
        data = data if isinstance(data, dict) else {}
        set_dotted(data, dotted, value)
    return parse_config(data, str(path))


def _has(data: dict[str, Any], dotted: str) -> bool:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`data["gateway"]["port"] = value` for dotted "gateway.port", making the levels missing."""
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
