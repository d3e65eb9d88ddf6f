"""A talker voice: an LM served by vLLM speaks each phrase as SNAC codec tokens (Orpheus's
layout), and a streaming SNAC decoder turns them into audio as they arrive.

The talker runs in the vocoder stage's process, as a second vLLM engine beside the reasoning
stage's: its engine core (weights, KV cache, CUDA graphs) is a process of its own, placed on
the vocoder's GPUs; this process holds the engine's front end, on an event loop thread of its
own, and the SNAC decoder. Every phrase is one vLLM request, so every caller's phrases are
decoded together by vLLM's continuous batching with paged KV; `advance` then decodes every
stream's ready frames in one SNAC batch. A cancel aborts the session's request from the
reader thread that reads the CANCEL, and the vocoder's acknowledgement carries the talker's KV
usage once the engine has applied the abort (`abort_stopped`), as the reasoning stage's does;
the reader does not wait for it.

Loads any talker of this layout: a Hugging Face id (in the cache) or a local folder, e.g.
canopylabs/orpheus-3b-0.1-ft with hubertsiuzdak/snac_24khz, or the random-weight ones that
`stages.backends.tiny_talker` builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from stages.backends.llm_vllm import ABORT_CONFIRM_TIMEOUT_S
from stages.backends.snac_codec import (
    TOKENS_PER_FRAME,
    CodeLayout,
    SnacDecoder,
    Window,
    frames_of,
    load_snac,
)
from stages.backends.speech import (
    MAX_CHUNK_MS,
    SpeechBackendError,
    SpeechOptionError,
    float_to_pcm16,
    reject_unknown_options,
    speak_by_blocks,
)
from stages.backends.speech import torch_device as load_device

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

    from stages.backends.llm_vllm import VllmEngine

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Orpheus's prompt: <custom_token_3> (start of human), the text, then end of text, end of
#: human, start of AI, start of speech; it ends speech with <custom_token_2>.
ORPHEUS_PROMPT_START = (128259,)
ORPHEUS_PROMPT_END = (128009, 128260, 128261, 128257)
ORPHEUS_STOP = (128258,)
_EMPTY = np.zeros(0, dtype=np.int16)
SLOW_FIRST_BLOCK_S = 1.0  # a phrase's first block later than this is logged with its timeline


class TalkerDeadError(SpeechBackendError):
    """The talker's vLLM engine died; the vocoder stage must be restarted."""


class TalkStream:
    """A phrase being spoken: the engine thread appends its tokens, `advance` decodes them."""

    def __init__(self, request_id: str, stop: Callable[[], bool]) -> None:
        self.request_id = request_id
        self.stop = stop
        self.tokens: list[int] = []  # appended by the engine's thread, under the voice's lock
        self.read = 0  # tokens turned into codes
        self.codes: list[int] = []
        self.emitted = 0  # frames whose audio is out
        self.finished = False  # the engine is done with the request
        self.error: BaseException | None = None
        self.done = False  # all of its audio is out, or it was stopped
        self.began = time.monotonic()
        self.first_token_at: float | None = None  # monotonic, set by the engine's thread
        self._closed: Callable[[TalkStream], None] | None = None

    def close(self) -> None:
        """No more audio for this phrase: its request is aborted (KV blocks freed)."""
        if not self.done:
            self.done = True
            if self._closed is not None:
                self._closed(self)


class TalkerVoice:
    """`BatchingVoice` (stages.vocoder) of a vLLM talker and a SNAC decoder."""

    def __init__(
        self,
        engine: VllmEngine,
        loop: _EngineLoop,
        codec: SnacDecoder,
        tokenizer: Any,
        *,
        params: SamplingParams,
        voice: str | None,
        layout: CodeLayout,
        prompt_start: Sequence[int],
        prompt_end: Sequence[int],
        first_frames: int,
        stream_frames: int,
        context_frames: int,
        lookahead_frames: int,
        first_lookahead_frames: int,
        max_frames_per_char: float,
        min_frames: int,
        wait_ms: float,
        chunk_ms: int,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self.codec = codec
        self.tokenizer = tokenizer
        self.name = f"talker ({engine.model}; codec {codec.name})"
        self.sample_rate = codec.sample_rate
        self._params = params
        self._voice = voice
        self.layout = layout
        self._prompt_start, self._prompt_end = list(prompt_start), list(prompt_end)
        self.first_frames, self.stream_frames = first_frames, stream_frames
        self.context_frames, self.lookahead_frames = context_frames, lookahead_frames
        self.first_lookahead_frames = first_lookahead_frames
        self._frames_per_char, self._min_frames = max_frames_per_char, min_frames
        self._wait_s = wait_ms / 1000
        self._chunk_ms = chunk_ms
        self._ids = itertools.count()
        self._live: dict[str, TalkStream] = {}  # requests the engine may still be running
        self._new_tokens = threading.Condition()

    @property
    def dead(self) -> bool:
        """The talker's engine core is gone: only a new process serves again."""
        return self.engine.dead

    # -- the Voice and BatchingVoice protocols --------------------------------------------

    def synthesize(self, text: str, stop: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Yield int16 chunks of ``text`` spoken as they are decoded; closing stops the
        request."""
        return speak_by_blocks(self, text, stop, self._chunk_ms)

    def begin(self, text: str, stop: Callable[[], bool] | None = None) -> TalkStream:
        """Start the talker's request for ``text``; its audio comes a block per `advance`."""
        stream = TalkStream(f"talk-{next(self._ids)}", stop or _never)
        stream._closed = self._abort_later
        prompt = self.prompt_ids(text)
        params = self._params.clone()
        frames = max(self._min_frames, math.ceil(len(text) * self._frames_per_char))
        params.max_tokens = frames * TOKENS_PER_FRAME
        with self._new_tokens:
            self._live[stream.request_id] = stream
        self._loop.spawn(self._generate(stream, prompt, params))
        return stream

    def advance(self, streams: Sequence[TalkStream]) -> list[np.ndarray]:
        """The next block of int16 audio of each stream: its frames decoded so far that have
        their lookahead (all that are left once its request is finished), at most
        `stream_frames` (`first_frames` for its first block), every stream's in one batch of
        the decoder. Waits up to ``wait_ms`` for tokens when no stream has a block yet; a
        stream that has none gets an empty block. A stream is `done` after its last block or
        once stopped."""
        if self.engine.dead:
            raise TalkerDeadError(f"the talker's vLLM engine on {self.engine.model!r} died")
        deadline = time.monotonic() + self._wait_s
        with self._new_tokens:
            while True:
                windows = [self._window(s) for s in streams]
                if any(w is not None for w in windows) or all(s.done for s in streams):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._new_tokens.wait(remaining)
        failed = [s for s in streams if s.error is not None]
        if failed:
            for s in failed:
                s.done = True
            error = failed[0].error
            raise SpeechBackendError(f"talker request failed: {type(error).__name__}: {error}")
        due = [(i, w) for i, w in enumerate(windows) if w is not None]
        blocks = [_EMPTY] * len(streams)
        if due:
            audio = self.codec.decode([w for _, w in due])
            for (i, w), samples in zip(due, audio, strict=True):
                blocks[i] = float_to_pcm16(samples)
                if not streams[i].emitted:
                    self._log_if_slow(streams[i])
                streams[i].emitted += w.emit
        with self._new_tokens:  # the last block of a finished request ends its stream
            for s in streams:
                if s.finished and s.read == len(s.tokens):
                    s.done = s.done or s.emitted >= len(s.codes) // TOKENS_PER_FRAME
        return blocks

    def _log_if_slow(self, stream: TalkStream) -> None:
        """A phrase whose first block took over a second: how long its first token took, and
        how busy the talker was."""
        now = time.monotonic()
        if now - stream.began <= SLOW_FIRST_BLOCK_S:
            return
        first = stream.first_token_at
        logger.info(
            "talker: %s: first block %.0f ms after it began, its first token after %s, "
            "%d tokens so far, %d requests live",
            stream.request_id,
            (now - stream.began) * 1000,
            "-" if first is None else f"{(first - stream.began) * 1000:.0f} ms",
            len(stream.tokens),
            len(self._live),
        )

    # -- requests ---------------------------------------------------------------------------

    def prompt_ids(self, text: str) -> list[int]:
        """The talker's prompt for ``text``: the layout's start and end tokens around
        ``voice: text`` (``text`` alone without a voice)."""
        spoken = f"{self._voice}: {text}" if self._voice else text
        ids = self.tokenizer(spoken)["input_ids"]
        return [*self._prompt_start, *ids, *self._prompt_end]

    def abort_stopped(
        self,
        then: Callable[[float | None], None],
        timeout: float = ABORT_CONFIRM_TIMEOUT_S + 1.0,
    ) -> None:
        """Abort every request whose stream says stop (a cancelled session's, its epoch moved
        on), and call `then` with the talker's KV usage once the engine has applied the aborts
        (None if that failed or took over `timeout` s).

        Called on the reader thread that reads a CANCEL, which goes on reading meanwhile: the
        engine frees the blocks at the end of its step in flight (tens of ms at 64 callers),
        and a release or another session's CANCEL behind this one must not wait for that.
        `then` runs on the engine's loop thread, or at once where there is nothing to wait for.

        The engine's loop checks `stop()` every step, so it often aborts the request itself
        before the CANCEL is read, and finds nothing left to stop here. That abort may not be
        applied yet, and an engine it leaves idle sends no later stats record: where no request
        is left, the usage is confirmed by the same round trip as an abort's."""
        with self._new_tokens:
            stopped = [s for s in self._live.values() if s.stop()]
        for s in stopped:
            s.done = True
        if not stopped and (
            self.engine.kv_usage() == 0.0 or self.engine.num_unfinished_requests() > 0
        ):
            then(self.engine.kv_usage())  # nothing held, or other requests share the cache
            return
        ids = [s.request_id for s in stopped]
        confirm = self._confirm_aborts(ids, then, timeout)
        try:
            self._loop.spawn(confirm)
        except RuntimeError:  # the engine's loop is closed: the voice is shutting down
            confirm.close()
            logger.warning("talker: %s not aborted: the engine's loop is closed", ids)
            then(None)

    async def _confirm_aborts(
        self, ids: list[str], then: Callable[[float | None], None], timeout: float
    ) -> None:
        kv: float | None = None
        try:
            kv = await asyncio.wait_for(self.engine.abort_confirmed(ids), timeout)
        except Exception:
            logger.exception("talker: aborting %s failed", ids)
        then(kv)

    def _abort_later(self, stream: TalkStream) -> None:
        if not stream.finished:
            self._loop.spawn(self.engine.abort(stream.request_id))

    async def _generate(self, stream: TalkStream, prompt: list[int], params: Any) -> None:
        """On the engine's loop: the request's tokens into ``stream`` as each step makes them."""
        try:
            if stream.done or stream.stop():
                return  # stopped before it started: nothing to abort
            async with contextlib.aclosing(
                self.engine.generate_ids(stream.request_id, prompt, params)
            ) as steps:
                async for ids in steps:
                    with self._new_tokens:
                        if stream.first_token_at is None:
                            stream.first_token_at = time.monotonic()
                        stream.tokens.extend(ids)
                        self._new_tokens.notify_all()
                    if stream.done or stream.stop():
                        break  # leaving closes the stream of steps: the request is aborted
        except Exception as exc:
            stream.error = exc
        finally:
            with self._new_tokens:
                stream.finished = True
                self._live.pop(stream.request_id, None)
                self._new_tokens.notify_all()

    def _window(self, stream: TalkStream) -> Window | None:
        """The stream's next block to decode, if it has one (called under the lock)."""
        if stream.done:
            return None
        if stream.stop():
            stream.done = True
            return None
        if stream.read < len(stream.tokens):
            stream.codes += self.layout.codes(stream.tokens[stream.read :])
            stream.read = len(stream.tokens)
        made = len(stream.codes) // TOKENS_PER_FRAME
        start = stream.emitted
        want = self.first_frames if start == 0 else self.stream_frames
        ahead = self.first_lookahead_frames if start == 0 else self.lookahead_frames
        if made - start >= want + ahead:
            emit, end = want, start + want + ahead
        elif stream.finished and made > start:
            emit, end = made - start, made
        else:
            return None
        first = max(0, start - self.context_frames)
        frames = frames_of(stream.codes[first * TOKENS_PER_FRAME : end * TOKENS_PER_FRAME])
        return Window(frames, start - first, emit)

    def warm_up_batches(self, most: int, timeout_s: float = 120.0) -> None:
        """Speak groups of 1, 2, 4, ... up to ``most`` phrases at once, each begun while the
        others decode. vLLM builds some kernels on the first step of a batch of a new size
        class, not at start-up: measured on an H200, the talker's engine stood still for about
        3.4 s the first time 8, and again 16, requests ran together, with every caller's audio
        waiting. They are built here instead."""
        deadline = time.monotonic() + timeout_s
        sizes = sorted({min(1 << i, most) for i in range(most.bit_length() + 1)})
        for n in sizes:
            streams: list[TalkStream] = []
            for _ in range(n):
                streams.append(self.begin("Hello there."))
                self.advance(streams)  # its prefill joins the others' decoding
            while not all(s.done for s in streams):
                if time.monotonic() > deadline:
                    for s in streams:
                        s.close()
                    logger.warning("talker: warming up batches of %d phrases timed out", n)
                    return
                self.advance(streams)

    def window_sizes(self) -> list[int]:
        """The window sizes a phrase's blocks take before they reach the steady one."""
        sizes, start = [], 0
        for want in (self.first_frames, self.stream_frames, self.stream_frames):
            ahead = self.first_lookahead_frames if start == 0 else self.lookahead_frames
            sizes.append(min(start, self.context_frames) + want + ahead)
            start += want
        return sorted(set(sizes))

    def close(self) -> None:
        """Stop the talker's engine (its processes) and its loop."""
        self._loop.close(self.engine)


class _EngineLoop:
    """The event loop vLLM's front end runs on: a thread of its own, since the vocoder's model
    loop is not asynchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="talker-loop", daemon=True
        )
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, engine: VllmEngine | None) -> None:
        async def finish() -> None:
            if engine is not None:
                engine.shutdown()  # on its loop, while it runs (llm_vllm says why)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_closed():
            return
        try:
            self.call(finish(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self.loop.close()


def _never() -> bool:
    return False


_OPTIONS = (
    "voice",
    "engine_args",
    "sampling",
    "audio_token_offset",
    "prompt_start",
    "prompt_end",
    "stop_token_ids",
    "first_frames",
    "stream_frames",
    "context_frames",
    "lookahead_frames",
    "first_lookahead_frames",
    "max_frames_per_char",
    "min_frames",
    "wait_ms",
    "chunk_ms",
    "codec_dtype",
    "cuda_graphs",
    "warmup",
    "warmup_streams",
)


def load_talker(
    model: str,
    codec: str,
    device: str = "cpu",
    *,
    voice: str | None = "tara",
    engine_args: Mapping[str, Any] | None = None,
    sampling: Mapping[str, Any] | None = None,
    audio_token_offset: int = CodeLayout.offset,
    prompt_start: Sequence[int] = ORPHEUS_PROMPT_START,
    prompt_end: Sequence[int] = ORPHEUS_PROMPT_END,
    stop_token_ids: Sequence[int] = ORPHEUS_STOP,
    first_frames: int = 1,
    stream_frames: int = 4,
    context_frames: int = 1,
    lookahead_frames: int = 1,
    first_lookahead_frames: int | None = None,
    max_frames_per_char: float = 2.0,
    min_frames: int = 4,
    wait_ms: float = 5.0,
    chunk_ms: int = MAX_CHUNK_MS,
    codec_dtype: str = "float32",
    cuda_graphs: bool = True,
    warmup: bool = True,
    warmup_streams: int | None = None,
    **unknown: Any,
) -> TalkerVoice:
    """Start the talker ``model`` (folder or cached hub id, with its tokenizer) in vLLM and load
    the SNAC ``codec`` on ``device``.

    ``voice``: the speaker name the prompt starts with (Orpheus: tara, leah, jess, leo, dan,
    mia, zac, zoe; None: none). ``engine_args`` and ``sampling`` go to vLLM (``sampling``'s
    defaults are Orpheus's: temperature 0.6, top_p 0.8, repetition_penalty 1.3).
    The layout: ``audio_token_offset``, ``prompt_start``, ``prompt_end``,
    ``stop_token_ids``. Streaming: ``first_frames`` frames (85 ms each) in a phrase's first
    block, ``stream_frames`` in each later one, each with ``lookahead_frames`` decoded after it
    and ``context_frames`` before; ``first_lookahead_frames`` (default ``lookahead_frames``)
    after the first block instead: 0 lets a phrase's first audio out a frame (7 tokens, one
    talker step each) sooner, its last few ms decoded without what follows (0.6% rms from a
    whole-phrase decode against 0.14%). ``max_frames_per_char`` (at least ``min_frames``)
    bounds a phrase's length. ``wait_ms``: how long `advance` waits for tokens when no stream has a
    block. ``cuda_graphs``: replay the decoder's regular windows as CUDA graphs on a GPU.
    ``warmup``: decode (or record) every window size now, and speak a word; then, with
    ``warmup_streams`` above 1 (default: 64 on a GPU, 1 on the CPU), speak that many phrases at
    once, in growing groups (`TalkerVoice.warm_up_batches`).
    """
    reject_unknown_options("talker", unknown, _OPTIONS)
    if first_lookahead_frames is None:
        first_lookahead_frames = lookahead_frames
    for key, value, low in (
        ("first_frames", first_frames, 1),
        ("stream_frames", stream_frames, 1),
        ("context_frames", context_frames, 0),
        ("lookahead_frames", lookahead_frames, 0),
        ("first_lookahead_frames", first_lookahead_frames, 0),
        ("min_frames", min_frames, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 64:
            raise SpeechOptionError(f"talker option {key}={value!r} must be an int in {low}..64")
    if not 0.05 <= max_frames_per_char <= 10:
        raise SpeechOptionError(
            f"talker option max_frames_per_char={max_frames_per_char!r} must be in 0.05..10"
        )
    if warmup_streams is not None and (
        isinstance(warmup_streams, bool)
        or not isinstance(warmup_streams, int)
        or not 1 <= warmup_streams <= 1024
    ):
        raise SpeechOptionError(
            f"talker option warmup_streams={warmup_streams!r} must be an int in 1..1024"
        )
    if not 0 <= wait_ms <= 100:
        raise SpeechOptionError(f"talker option wait_ms={wait_ms!r} must be in 0..100")
    if not (prompt_start or prompt_end) or not stop_token_ids:
        raise SpeechOptionError("talker options prompt_start/prompt_end and stop_token_ids: none")
    torch_device = load_device(device, "talker")
    layout = CodeLayout(offset=audio_token_offset)
    sampling = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3, **(sampling or {})}
    sampling |= {"stop_token_ids": list(stop_token_ids), "detokenize": False}
    engine_args = {"skip_tokenizer_init": True, **(engine_args or {})}

    from transformers import AutoTokenizer

    from stages.backends.llm_vllm import VllmEngine, build_sampling_params, resolve_model
    from stages.backends.speech import load_error

    resolved = resolve_model(model)
    codec_decoder = load_snac(codec, torch_device, codec_dtype, cuda_graphs)
    params = build_sampling_params(sampling)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved)
    except Exception as exc:
        raise load_error("talker tokenizer", resolved, exc) from exc
    loop = _EngineLoop()
    try:
        engine = loop.call(VllmEngine.start(resolved, engine_args, sampling))
    except BaseException:
        loop.close(None)
        raise
    voice_ = TalkerVoice(
        engine,
        loop,
        codec_decoder,
        tokenizer,
        params=params,
        voice=voice,
        layout=layout,
        prompt_start=prompt_start,
        prompt_end=prompt_end,
        first_frames=first_frames,
        stream_frames=stream_frames,
        context_frames=context_frames,
        lookahead_frames=lookahead_frames,
        first_lookahead_frames=first_lookahead_frames,
        max_frames_per_char=max_frames_per_char,
        min_frames=min_frames,
        wait_ms=wait_ms,
        chunk_ms=chunk_ms,
    )
    if warmup:
        try:
            codec_decoder.warm_up(voice_.window_sizes())
            for _ in voice_.synthesize("Hello."):
                pass
            streams = warmup_streams or (64 if torch_device.type == "cuda" else 1)
            if streams > 1:
                voice_.warm_up_batches(streams)
        except BaseException:
            voice_.close()
            raise
    return voice_
