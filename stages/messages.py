"""Record kinds and payload schemas for everything that crosses a ring, defined once.

Every ring record carries `kind` and `session` in its header (plus epoch, seq and a
CLOCK_MONOTONIC stamp). Audio travels as raw PCM16 bytes, read zero-copy; every other
payload is a msgspec Struct encoded as a MessagePack array (no pickles, no field names on
the wire), looked up by the record's kind.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

# The caller's audio as the gateway hears it and the AUDIO_IN record carries it to the
# encoder: PCM16 mono at CALLER_RATE, read by the gateway's VAD in frames of FRAME_MS and sent
# in chunks of CHUNK_MS (a turn's last chunk is shorter).
CALLER_RATE = 16_000
FRAME_MS = 20
FRAME_SAMPLES = CALLER_RATE * FRAME_MS // 1000  # 320
CHUNK_MS = 200
CHUNK_SAMPLES = CALLER_RATE * CHUNK_MS // 1000  # 3,200


class Kind(enum.IntEnum):
    # gateway -> encoder
    AUDIO_IN = 1  # raw PCM16 mono at CALLER_RATE, CHUNK_MS a record but for a turn's last
    SPEECH_STARTED = 2
    SPEECH_STOPPED = 3
    TURN_PAUSED = 4  # the caller paused: prepare the reply, hold it until SPEECH_STOPPED
    TURN_RESUMED = 5  # ... or drop it: the caller went on (encoder -> reasoning too)
    # encoder -> gateway, encoder -> reasoning
    TRANSCRIPT = 10
    # encoder -> reasoning, speech-in: the audio tower's embeddings of a turn as it is spoken
    AUDIO_EMBEDDINGS = 11
    # gateway -> reasoning
    RESPONSE_CREATE = 20
    TRUNCATE = 21
    HISTORY = 22  # the client edited the conversation: here is all of it
    SESSION_SETTINGS = 23  # session.update: instructions, output modality, token cap
    RESPONSE_STOP = 24  # (and -> vocoder) a reply that started over the caller: drop it unheard
    # reasoning -> vocoder, reasoning -> gateway
    RESPONSE_STARTED = 30
    TEXT_DELTA = 31
    RESPONSE_DONE = 32
    RESPONSE_RELEASE = 33  # reasoning -> vocoder: a reply made early goes out now, or never
    # reasoning -> gateway: a function call the reply makes, and its arguments as they stream
    TOOL_CALL = 34
    TOOL_ARGUMENTS = 35
    # vocoder -> gateway
    AUDIO_OUT = 40  # raw PCM16 mono at the vocoder's rate, <= 100 ms
    PHRASE = 41  # which text the audio that follows speaks
    AUDIO_DONE = 42
    # gateway -> every stage, and their answers
    SESSION_OPEN = 50
    SESSION_CLOSE = 51
    CANCEL = 52
    CANCEL_ACK = 53
    ERROR = 54


class Msg(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Base of every payload schema."""


class SpeechStarted(Msg):
    turn_id: int
    audio_start_ms: int = 0
    # the caller speaks over the agent, and the gateway decides from the transcript whether
    # that is an interruption (gateway.turns.interruption): no speech-in rows are made for it
    provisional: bool = False


class SpeechStopped(Msg):
    turn_id: int
    audio_end_ms: int = 0
    create_response: bool = True
    # the caller spoke over the agent, and the gateway decides from the transcript whether
    # that was an interruption (gateway.turns.interruption): reasoning is not sent it
    provisional: bool = False


class TurnPaused(Msg):
    """The caller paused mid-turn (gateway.prepare_reply_ms of silence): the encoder
    transcribes the turn so far and reasoning starts on it, both held back until the turn ends
    (SPEECH_STOPPED) or dropped if it goes on (TURN_RESUMED)."""

    turn_id: int
    create_response: bool = True
    # the silence the turn will end with beyond this pause if nothing more is said: the turn
    # so far is transcribed with as much silence after it, so that the transcript at the pause
    # is the one the whole turn would get (Whisper's words move with the audio's length)
    silence_to_come_ms: int = 0


class TurnResumed(Msg):
    turn_id: int


class Transcript(Msg):
    turn_id: int
    text: str
    final: bool
    create_response: bool = True  # from the SPEECH_STOPPED it answers
    # CLOCK_MONOTONIC of the SPEECH_STOPPED record this final transcript answers (0 for partials)
    speech_stopped_ns: int = 0
    # recognizer time after the SPEECH_STOPPED stamp: audio still being decoded, then the final
    # decode (model time on the path to the reply, for the pipeline overhead)
    decode_ns: int = 0
    # the turn so far at a TURN_PAUSED: reasoning starts the reply on it (the final transcript,
    # the same text when the caller did not go on, commits it); the gateway reads `finished`
    speculative: bool = False
    # speculative only: how likely the words end the caller's turn (0..1, from
    # encoder.end_of_turn_words; -1: not judged), weighed by semantic_vad
    finished: float = -1.0


class AudioEmbeddings(Msg):
    """Speech-in (stages.backends.speech_in): rows of a turn's audio in the language model's
    embedding space, made by the audio tower in the encoder stage as the caller speaks. A
    window's rows are sent once it is complete and never change (`seq` counts a turn's
    records from 0): reasoning prefills the turn so far from them. `final`: the last rows,
    as the turn ended (SPEECH_STOPPED); `speculative`: the rows of the open window at a
    pause (TURN_PAUSED), on which the reply is prepared and held. `data` is `rows` x `dim`
    values of `dtype` ("bfloat16", "float16" or "float32"), row-major."""

    turn_id: int
    seq: int
    rows: int
    dim: int
    dtype: str
    data: bytes
    final: bool = False
    speculative: bool = False
    create_response: bool = True  # from the SPEECH_STOPPED or TURN_PAUSED it answers
    # a final whose turn said nothing since the pause: the rows at the pause stand
    as_paused: bool = False
    speech_stopped_ns: int = 0  # CLOCK_MONOTONIC of the SPEECH_STOPPED a final answers


class Tool(Msg):
    """A function the model may call: its name, description and JSON Schema parameters
    (JSON text, as the client gave it)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'


class ToolCall(Msg):
    """A function call the model made (or, in a history, had made): `arguments` is JSON text."""

    call_id: str
    name: str
    arguments: str


class Tools(Msg):
    """Which tools a reply may call, and how: `choice` is "auto", "none", "required" or
    "function" (then `function` names the one it must call)."""

    tools: list[Tool] = []
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True


class SessionOpen(Msg):
    instructions: str | None = None  # system prompt; None keeps the configured one
    voice: str | None = None
    max_output_tokens: int | None = None


class SessionClose(Msg):
    reason: str = "closed"


class ResponseCreate(Msg):
    """Start a reply now; `text` appends a user turn first (a typed message). Fields left
    None take the session's settings."""

    response_id: str
    text: str | None = None
    instructions: str | None = None
    audio: bool | None = None  # speak it (False: text only, the vocoder stays out)
    max_output_tokens: int | None = None
    paced: bool = True  # False: synthesize as fast as possible (/v1/audio/speech)
    tools: Tools | None = None  # None: the session's


class HistoryMessage(Msg):
    role: str  # "user", "assistant", "system" or "tool"
    text: str
    tool_calls: list[ToolCall] = []  # an assistant's: the calls it made after its text
    call_id: str | None = None  # a tool's: the call whose output `text` is


class History(Msg):
    """The whole conversation as the client now has it (after an item create, delete or
    truncate); replaces the stage's copy."""

    messages: list[HistoryMessage]


class SessionSettings(Msg):
    """A session.update's part that the reasoning stage applies to every later reply."""

    instructions: str | None = None  # None: the configured system prompt
    audio: bool = True
    max_output_tokens: int | None = None  # None: the configured sampling.max_tokens
    tools: Tools = Tools()


class ResponseStop(Msg):
    """Stop one reply, unheard, with no cancel: it started while the caller was speaking, and
    a cancel (an epoch bump) would purge the turn they are in. Ignored if `response_id` is not
    the session's reply any more."""

    response_id: str


class Truncate(Msg):
    """Cut the assistant's reply to what the caller actually heard."""

    response_id: str
    spoken_text: str


class ResponseStarted(Msg):
    response_id: str
    turn_id: int  # the user turn it answers; -1 for an explicit response.create
    audio: bool = True  # False: a text-only reply, which the vocoder ignores
    paced: bool = True  # False: the vocoder need not keep pace with playback
    # vocoder only: a reply started at the caller's pause; its audio is made but kept back
    # until a RESPONSE_RELEASE says whether the turn ended as it was
    held: bool = False
    tools: bool = False  # it may call functions: its message may never come


class TextDelta(Msg):
    response_id: str
    text: str
    index: int  # position of the delta in the reply
    # on the first delta: ns from handing the request to the engine to this token (model time)
    since_submit_ns: int = 0


class BadToolCall(Msg):
    index: int
    name: str
    arguments: str
    reason: str


class ToolCallStarted(Msg):
    """The reply calls a function: the `index`th call of the reply (its arguments follow as
    TOOL_ARGUMENTS, and the call as made comes in RESPONSE_DONE)."""

    response_id: str
    index: int
    call_id: str
    name: str


class ToolArguments(Msg):
    response_id: str
    index: int
    delta: str


class ResponseDone(Msg):
    response_id: str
    status: str  # "completed", "cancelled", "incomplete" or "failed"
    text: str  # whole reply as generated (the spoken part comes back through PHRASE)
    output_tokens: int = 0
    first_token_ns: int = 0
    # the prompt as the engine took it: its positions, of which audio rows (speech-in), and
    # those found in the prefix cache (the usage of response.done)
    input_tokens: int = 0
    input_audio_tokens: int = 0
    cached_tokens: int = 0
    # a failed reply's reason, a code (generation_failed, engine_dead, tool_template); the
    # stage's log has what an exception said, which is not the client's to read, unless it is
    # one of the stage's own, written for them (`error_message`)
    error: str = ""
    error_message: str = ""
    # the function calls it made, in order (gateway only); a call whose arguments are not a
    # JSON object, or which names no tool, is in `bad_calls` instead, with why
    tool_calls: list[ToolCall] = []
    bad_calls: list[BadToolCall] = []


class ResponseRelease(Msg):
    """The turn a held reply was started for has ended: send what was made (`keep`), or drop
    it, the caller having gone on."""

    response_id: str
    keep: bool


class Phrase(Msg):
    """The audio records that follow, up to the next PHRASE, speak `text`."""

    response_id: str
    text: str
    sample_rate: int
    # the stamp of the TEXT_DELTA (or RESPONSE_DONE) record that completed the phrase: how long
    # the phrase waited for its words (model time) and then for the vocoder (scheduling)
    ready_ns: int = 0


class AudioDone(Msg):
    response_id: str
    status: str  # "completed" or "cancelled"


class Cancel(Msg):
    cancel_id: int
    response_id: str | None = None
    spoken_text: str | None = None  # what the caller heard of the reply, for the history
    reason: str = "barge_in"


class CancelAck(Msg):
    cancel_id: int
    stage: str
    t_ns: int  # CLOCK_MONOTONIC when the stage had stopped everything
    kv_usage: float | None = None  # reasoning and a talker: KV-cache usage after the abort


class Error(Msg):
    stage: str
    code: str
    message: str


# Error.code of the supervisor's word that a stage died and was purged of the session: nothing
# more of what that stage was making for it will come
STAGE_RESTARTED = "stage_restarted"


SCHEMAS: dict[Kind, type[Msg]] = {
    Kind.SPEECH_STARTED: SpeechStarted,
    Kind.SPEECH_STOPPED: SpeechStopped,
    Kind.TURN_PAUSED: TurnPaused,
    Kind.TURN_RESUMED: TurnResumed,
    Kind.TRANSCRIPT: Transcript,
    Kind.AUDIO_EMBEDDINGS: AudioEmbeddings,
    Kind.RESPONSE_CREATE: ResponseCreate,
    Kind.TRUNCATE: Truncate,
    Kind.RESPONSE_STOP: ResponseStop,
    Kind.HISTORY: History,
    Kind.SESSION_SETTINGS: SessionSettings,
    Kind.RESPONSE_STARTED: ResponseStarted,
    Kind.TEXT_DELTA: TextDelta,
    Kind.RESPONSE_DONE: ResponseDone,
    Kind.RESPONSE_RELEASE: ResponseRelease,
    Kind.TOOL_CALL: ToolCallStarted,
    Kind.TOOL_ARGUMENTS: ToolArguments,
    Kind.PHRASE: Phrase,
    Kind.AUDIO_DONE: AudioDone,
    Kind.SESSION_OPEN: SessionOpen,
    Kind.SESSION_CLOSE: SessionClose,
    Kind.CANCEL: Cancel,
    Kind.CANCEL_ACK: CancelAck,
    Kind.ERROR: Error,
}
KIND_OF: dict[type[Msg], Kind] = {cls: kind for kind, cls in SCHEMAS.items()}
RAW_KINDS = frozenset({Kind.AUDIO_IN, Kind.AUDIO_OUT})

_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in SCHEMAS.items()}


class BadRecord(ValueError):
    """A record whose kind or payload does not match any schema."""


def encode(msg: Msg) -> tuple[Kind, bytes]:
    """(kind, payload bytes) for a message."""
    return KIND_OF[type(msg)], _encoder.encode(msg)


def decode(kind: int, payload: Any) -> Msg | memoryview | bytes:
    """The message of a record: a Struct, or the raw buffer for audio kinds."""
    try:
        k = Kind(kind)
    except ValueError:
        raise BadRecord(f"unknown record kind {kind}") from None
    if k in RAW_KINDS:
        return payload
    try:
        return _decoders[k].decode(payload)
    except msgspec.DecodeError as exc:
        raise BadRecord(f"bad {k.name} payload: {exc}") from exc
