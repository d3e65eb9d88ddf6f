"""vLLM engine layer of the reasoning stage and of the talker voice (tts_talker).

``VllmEngine`` wraps vLLM's ``AsyncLLM`` (the v1 engine front end; the engine core runs in its
own process) and gives the stages what they need: chat messages in and text deltas out as each
token is sampled (reasoning), or token ids in and out (a talker's codec tokens), idempotent aborts,
and the engine's KV-cache usage so a CANCEL can report that the aborted request's blocks were freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import difflib
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stages.backends.gloo_device import SHARED_GLOO_ENV
from stages.backends.tiny_chat_model import has_random_weights
from stages.backends.vllm_stats import KvUsageMonitor, kv_stat_logger_class
from stages.rundir import owned_folder

# vLLM is imported lazily (importing it takes ~10 s) and, the first time, in a thread of its own:
# see _import_vllm.
if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

GiB = 1 << 30
#: KV cache reserved on the CPU when neither ``kv_cache_memory_bytes`` nor
#: ``VLLM_CPU_KVCACHE_SPACE`` is given; vLLM's own default tries to reserve 92% of RAM.
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB
# How long a cancel's ack waits for vLLM to show its abort applied before it reports the usage
# as last seen (an abort wait `timed_out`). On a GPU that is the rest of one step, a few ms; the
# bound is for an engine core starved of CPU, whose steps take up to a third of a second on 2
# busy cores, where a true figure late is worth more than a stale one at once. Each cancel
# waits in a task of its own, so no other session waits with it.
ABORT_CONFIRM_TIMEOUT_S = 1.0


@dataclasses.dataclass
class PromptUsage:
    """What a request's prompt cost, as the engine reported it: its positions (tokens and
    embedding rows), those found in the prefix cache, and the tokens generated."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def take(self, output: Any) -> None:
        """Read one step's vLLM RequestOutput (its tokens are the step's: DELTA outputs)."""
        if output.prompt_token_ids is not None:
            self.prompt_tokens = len(output.prompt_token_ids)
        elif getattr(output, "prompt_embeds", None) is not None:
            self.prompt_tokens = len(output.prompt_embeds)
        self.cached_tokens = output.num_cached_tokens or 0
        if output.outputs:
            self.output_tokens += len(output.outputs[0].token_ids)


class VllmEngineError(RuntimeError):
    """Base class of the errors this module raises."""


class ModelNotFoundError(VllmEngineError, FileNotFoundError):
    """The model path does not exist or is not a model folder."""


class EngineConfigError(VllmEngineError, ValueError):
    """An engine argument or sampling parameter is unknown or has a bad value."""


class EngineStartError(VllmEngineError):
    """vLLM failed to start (the engine core process died or refused the configuration)."""


class EngineDeadError(VllmEngineError):
    """The engine core process died while serving; the engine must be restarted."""


def _import_vllm() -> None:
    """Import the parts of vLLM this module uses.

    The first import of ``vllm.sampling_params`` leaves every frame then on the stack referenced
    for good (seen with ``gc.get_referrers``: a list that holds the importing frames). Imported
    inside ``start()``, that frame kept the ``AsyncLLM`` alive until interpreter exit, where its
    ``__del__`` failed. ``start()`` runs this in a throwaway thread so only that thread's frames
    are kept.
    """
    import vllm.engine.arg_utils
    import vllm.platforms
    import vllm.renderers.params
    import vllm.sampling_params
    import vllm.v1.engine.async_llm
    import vllm.v1.engine.exceptions
    import vllm.v1.metrics.loggers  # noqa: F401


def resolve_model(model: str) -> str:
    """Return a local model folder as an absolute path; leave a hub model id as it is.

    Raises ``ModelNotFoundError`` naming the path when ``model`` is written as a path (absolute,
    ``./``, ``../`` or ``~``) but is missing or is not a Hugging Face model folder.
    """
    path = Path(model).expanduser()
    looks_like_path = model.startswith(("/", ".", "~"))
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
        return str(path.resolve())
    if looks_like_path:
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    return model


def build_engine_args(model: str, engine_args: Mapping[str, Any]) -> AsyncEngineArgs:
    """``AsyncEngineArgs`` from the config's engine args, with defaults that the CPU needs.

    Unknown keys raise ``EngineConfigError`` naming the key (and the closest valid names).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    args = dict(engine_args)
    if "model" in args:
        raise EngineConfigError("engine arg 'model' is given twice: pass it as the model instead")
    for key in args:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise EngineConfigError(f"unknown vLLM engine arg {key!r}{hint}")
    # Stats must flow: the KV usage that CANCEL_ACK reports comes from the stat loggers.
    args["disable_log_stats"] = False
    args.setdefault("use_tqdm_on_load", False)  # a progress bar in the stage's log otherwise
    if current_platform.is_cpu():
        # torch.compile costs ~30 s of start-up on the CPU and gains nothing on small models.
        args.setdefault("enforce_eager", True)
        # The legacy VLLM_CPU_KVCACHE_SPACE variable, when set, overrides this in vLLM itself.
        args.setdefault("kv_cache_memory_bytes", DEFAULT_CPU_KV_CACHE_BYTES)
    try:
        return AsyncEngineArgs(model=model, **args)
    except Exception as exc:
        raise _config_error(model, exc) from exc


def _config_error(model: str, exc: Exception) -> VllmEngineError:
    """The typed error for vLLM refusing the configuration (``exc``) of ``model``."""
    if isinstance(exc, OSError):  # transformers / huggingface_hub: model files not found
        where = "the folder" if Path(model).is_dir() else "the Hugging Face cache or hub"
        return ModelNotFoundError(f"cannot load model {model!r} from {where}: {exc}")
    return EngineConfigError(f"vLLM rejected the engine args for {model!r}: {exc}")


def build_sampling_params(sampling: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams`` streaming text deltas; a bad key or value is an ``EngineConfigError``."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    known = set(SamplingParams.__struct_fields__)
    for key in sampling:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise EngineConfigError(f"unknown sampling parameter {key!r}{hint}")
    params = {k: v for k, v in sampling.items() if k != "output_kind"}
    try:
        return SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
    except (TypeError, ValueError) as exc:
        raise EngineConfigError(f"bad sampling parameters {params!r}: {exc}") from exc


SOCKETS_PREFIX = "omni-vllm-"  # then the engine's process id (stages.rundir)
_SOCKETS_ENV = "VLLM_RPC_BASE_PATH"


@contextlib.contextmanager
def _sockets_in(folder: Path) -> Iterator[None]:
    """Have vLLM make its ZMQ sockets in ``folder`` while it starts.

    vLLM names them under VLLM_RPC_BASE_PATH (the system's temporary folder by default) as its
    engine starts, and never removes them: every start left a few more in /tmp. The engine core
    process inherits the setting as it is spawned.
    """
    before = os.environ.get(_SOCKETS_ENV)
    os.environ[_SOCKETS_ENV] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_SOCKETS_ENV, None)
        else:
            os.environ[_SOCKETS_ENV] = before


class VllmEngine:
    """A vLLM ``AsyncLLM`` that streams chat replies as text deltas. Create with ``start()``."""

    def __init__(
        self,
        llm: AsyncLLM,
        model: str,
        sampling: Mapping[str, Any],
        kv_monitor: KvUsageMonitor,
        socket_dir: Path | None = None,
    ) -> None:
        self._llm: AsyncLLM | None = llm
        self.model = model
        self._sampling = dict(sampling)
        self._default_params = build_sampling_params(self._sampling)
        self._kv = kv_monitor
        self._tokenizer: Any = None  # the model's, for counting prompts (made on first use)
        # vLLM's sockets: removed at shutdown, or at the next start in this machine if the
        # process was killed
        self.socket_dir = socket_dir

    @classmethod
    async def start(
        cls,
        model: str,
        engine_args: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
    ) -> VllmEngine:
        """Start vLLM on ``model`` (a local folder or a model id) and wait until it is ready.

        ``engine_args`` go to ``AsyncEngineArgs`` unchanged (plus CPU defaults: eager mode and a
        1 GiB KV cache); ``sampling`` is the default ``SamplingParams`` of every request.
        Start-up takes about 20 s on the CPU; it runs in a thread so the event loop stays live.
        """
        resolved = resolve_model(model)
        await _run_in_thread(_import_vllm, name="vllm-import")
        from vllm.v1.engine.async_llm import AsyncLLM

        sampling = dict(sampling or {})
        build_sampling_params(sampling)  # fail on a bad key before spending 20 s on start-up
        if Path(resolved).is_dir() and has_random_weights(Path(resolved)):
            logger.warning("model %s has random weights: its replies are noise", resolved)
        args = build_engine_args(resolved, engine_args or {})
        monitor = KvUsageMonitor()

        socket_dir = owned_folder(SOCKETS_PREFIX)
        # the engine's processes inherit it: their gloo groups share one polling loop
        # (stages/backends/gloo_device.py)
        os.environ.setdefault(SHARED_GLOO_ENV, "1")

        def create() -> AsyncLLM:
            try:
                config = args.create_engine_config()
            except Exception as exc:
                raise _config_error(resolved, exc) from exc
            try:
                with _sockets_in(socket_dir):
                    return AsyncLLM.from_vllm_config(
                        config,
                        stat_loggers=[functools.partial(kv_stat_logger_class(), monitor=monitor)],
                        disable_log_stats=False,
                    )
            except Exception as exc:
                # The engine core process logs the root cause; its failure reaches us only as
                # "Engine core initialization failed".
                raise EngineStartError(
                    f"vLLM failed to start on model {resolved!r}: {type(exc).__name__}: {exc} "
                    "(the cause is in the EngineCore log lines above)"
                ) from exc

        started = time.monotonic()
        try:
            llm = await _run_in_thread(create, name="vllm-start")
        except BaseException:
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        logger.info("vLLM engine on %s ready in %.1f s", resolved, time.monotonic() - started)
        return cls(llm, resolved, sampling, monitor, socket_dir)

    async def generate(
        self,
        request_id: str,
        messages: list[dict[str, Any]],
        sampling: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """Stream the reply to ``messages`` (OpenAI chat format) as text deltas (see
        `generate_pieces`)."""
        async with contextlib.aclosing(
            self.generate_pieces(request_id, messages, sampling)
        ) as pieces:
            async for text, _, _ in pieces:
                if text:
                    yield text

    async def generate_pieces(
        self,
        request_id: str,
        messages: list[dict[str, Any]],
        sampling: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        usage: PromptUsage | None = None,
    ) -> AsyncIterator[tuple[str, list[int], bool]]:
        """Stream the reply to ``messages`` (OpenAI chat format) as (text, token ids,
        finished), a piece per engine step; ``usage`` is kept up to date as it goes.

        The chat template (the model's, or ``chat_template``) is applied by vLLM's renderer,
        with ``tools`` (Chat Completions form) for the template to list. ``sampling``
        overrides the engine's default sampling parameters for this request. The stream ends
        when the reply is finished or the request is aborted. If the consumer is cancelled or
        closes the generator, the request is aborted here, so its KV blocks are freed at once.
        """
        from vllm.renderers.params import ChatParams

        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        kwargs: dict[str, Any] = {"add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        chat_params = ChatParams(chat_template=chat_template, chat_template_kwargs=kwargs)
        llm = self._llm
        # a copy: the renderer rewrites messages in place (a call's arguments become a dict),
        # and these are the session's history
        messages = copy.deepcopy(messages)
        _, (prompt,) = await llm.renderer.render_chat_async([messages], chat_params)
        replies = self.generate_prompt(request_id, prompt, sampling, usage)
        async with contextlib.aclosing(replies) as out:
            async for piece in out:
                yield piece

    async def generate_prompt(
        self,
        request_id: str,
        prompt: Mapping[str, Any],
        sampling: Mapping[str, Any] | None = None,
        usage: PromptUsage | None = None,
    ) -> AsyncIterator[tuple[str, list[int], bool]]:
        """Stream the reply to a prompt already made (token ids, or a mixed prompt of token ids
        and `prompt_embeds`: stages.speech_in) as (text, token ids, finished) pieces, as
        `generate_pieces` does."""
        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        params = (
            build_sampling_params({**self._sampling, **sampling})
            if sampling
            else self._default_params.clone()
        )
        steps = self._completions(prompt, params, request_id, usage)
        async with contextlib.aclosing(steps) as completions:
            async for completion in completions:
                # The text is empty when the detokenizer holds back an incomplete UTF-8
                # sequence (its tokens come again with the rest)
                finished = completion.finish_reason is not None
                if completion.text or finished:
                    yield completion.text, list(completion.token_ids), finished

    async def prefill(self, request_id: str, prompt: Mapping[str, Any]) -> int:
        """Compute `prompt` and sample one token, which is dropped: its full blocks stay in
        vLLM's prefix cache for a later request that starts the same way. Returns how many of
        its positions were found cached already. Cancelled, it is aborted."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        usage = PromptUsage()
        steps = self._completions(prompt, params, request_id, usage)  # aborted if cancelled
        async with contextlib.aclosing(steps) as completions:
            async for _ in completions:
                pass
        return usage.cached_tokens

    async def generate_ids(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[int]]:
        """Stream the token ids generated after ``prompt_ids``, the new ones of each engine
        step. Ends when the request finishes or is aborted; a consumer that goes away aborts
        it (its KV blocks freed at once), as in `generate_pieces`."""
        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        prompt = {"prompt_token_ids": prompt_ids}
        async with contextlib.aclosing(self._completions(prompt, params, request_id)) as steps:
            async for completion in steps:
                if completion.token_ids:
                    yield list(completion.token_ids)

    async def _completions(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        usage: PromptUsage | None = None,
    ) -> Any:
        """vLLM's completion of the request, the piece of each engine step; ``usage`` reads
        each step's output."""
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        assert self._llm is not None
        try:
            async with contextlib.aclosing(
                self._llm.generate(prompt, params, request_id)
            ) as outputs:
                async for output in outputs:
                    if usage is not None:
                        usage.take(output)
                    for completion in output.outputs:
                        yield completion
        except (asyncio.CancelledError, GeneratorExit):
            # The one place a stream's consumer going away turns into an abort. (Closing vLLM's
            # own generator above aborts too; aborts are idempotent.)
            try:
                await self.abort(request_id)
            except Exception:
                logger.exception("abort of request %s failed", request_id)
            raise
        except VllmEngineDeadError as exc:
            raise EngineDeadError(f"vLLM engine on {self.model!r} died: {exc}") from exc

    async def abort_confirmed(
        self, request_ids: list[str], timeout: float = ABORT_CONFIRM_TIMEOUT_S
    ) -> float:
        """Abort ``request_ids`` and return the KV usage once the engine has applied the abort
        (`kv_usage_after_abort`)."""
        seq, usage = self.kv_stats_seq(), self.kv_usage()
        for request_id in request_ids:
            await self.abort(request_id)
        sent = self.kv_stats_seq()
        return await self.kv_usage_after_abort(seq, usage, timeout, sent_seq=sent)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's), made on first use."""
        if self._tokenizer is None:
            if self._llm is None:
                raise VllmEngineError(f"engine on {self.model!r} is shut down")
            self._tokenizer = self._llm.get_tokenizer()
        return self._tokenizer

    async def reset_prefix_cache(self) -> None:
        """Forget every cached block (for measurements that start cold)."""
        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        await self._llm.reset_prefix_cache()

    @property
    def hidden_size(self) -> int:
        """The model's hidden size: the width of an embedding row it takes."""
        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        return int(self._llm.model_config.get_hidden_size())

    def prompt_budget(self, max_output_tokens: int | None = None) -> int:
        """The prompt tokens that leave room in the context for a reply of
        `max_output_tokens` (or the configured max_tokens; 256 without one)."""
        if self._llm is None:
            raise VllmEngineError(f"engine on {self.model!r} is shut down")
        reply = max_output_tokens or self._sampling.get("max_tokens") or 256
        context = self._llm.model_config.max_model_len
        return max(1, context - min(int(reply), context // 2))

    def prompt_tokens(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> int:
        """Tokens of ``messages`` as the model is prompted with them (its chat template, or
        ``chat_template``, listing ``tools``)."""
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=chat_template,
            tokenize=True,
            add_generation_prompt=True,
        )
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    @property
    def dead(self) -> bool:
        """The engine core process is gone (vLLM's own watch on it says so): every request
        from now on fails, and only a new engine serves again."""
        return self._llm is not None and self._llm.errored

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"vLLM engine on {self.model!r} died: its engine core is gone")

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``; its stream ends and its KV blocks are freed. Safe to repeat."""
        if self._llm is None:
            return
        await self._llm.abort(request_id)

    def kv_usage(self) -> float:
        """KV-cache usage (0.0–1.0) from the engine's most recent scheduler stats."""
        return self._kv.usage

    async def wait_kv_idle(self, timeout: float = 1.0) -> float:
        """Wait until the engine reports no KV blocks in use and return that usage.

        Raises ``TimeoutError`` (with the usage left) if it is not idle within ``timeout`` s.
        """
        return await self._kv.wait_idle(timeout)

    def kv_stats_seq(self) -> int:
        """How many scheduler-stats records the engine has sent so far."""
        return self._kv.seq

    async def kv_usage_after_abort(
        self,
        seq_before: int,
        usage_before: float,
        timeout: float = ABORT_CONFIRM_TIMEOUT_S,
        *,
        sent_seq: int | None = None,
    ) -> float:
        """KV usage once an abort, asked for at stats record `seq_before` and sent by record
        `sent_seq` (default: the same), has been applied.

        The engine core applies aborts eagerly, within the step in flight, and sends stats once
        per step. The first record after the abort shows the freed blocks unless it left the
        core just before the abort arrived; so a record after `seq_before` counts if it shows
        less usage than `usage_before` or an empty scheduler, and otherwise the second record
        after `sent_seq` is taken. (Records handled while the abort was being sent, e.g. behind
        a busy event loop, were made before it reached the core.) Where no request is left the
        engine may send no further record, and a round trip through it confirms instead. Past
        `timeout` the latest usage is returned.
        """
        kv, deadline = self._kv, time.monotonic() + timeout
        if usage_before == 0.0 and kv.requests == 0:
            kv.abort_waits.add("nothing_held")
            return 0.0  # nothing was held, and an idle engine sends no stats to wait for
        if self._llm is not None and self.num_unfinished_requests() == 0:
            # The aborts leave the engine nothing to run: it goes idle and may send no record
            # after the abort. A round trip through its input queue, which it reads in order,
            # says the aborts are applied; with no request left nothing is held.
            try:
                await asyncio.wait_for(self._llm.is_sleeping(), timeout)
            except TimeoutError:
                kv.abort_waits.add("timed_out")
                return kv.usage
            kv.abort_waits.add("idle_after_abort")
            return 0.0
        sent_seq = seq_before if sent_seq is None else sent_seq
        while True:
            seen = kv.seq - seq_before
            if seen >= 1 and (kv.usage < usage_before or kv.requests == 0):
                kv.abort_waits.add("freed_first_step" if seen == 1 else "freed_later_step")
                return kv.usage
            if kv.seq - sent_seq >= 2:
                kv.abort_waits.add("hidden")
                return kv.usage
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                kv.abort_waits.add("timed_out")
                return kv.usage
            await kv.wait_seq(kv.seq + 1, remaining)

    def num_unfinished_requests(self) -> int:
        """Requests the engine is still serving (0 once every stream has ended or been aborted)."""
        # the output processor's count: vLLM 0.26's AsyncLLM has no method for it (0.32's has)
        return 0 if self._llm is None else self._llm.output_processor.get_num_unfinished_requests()

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the engine's processes (about 5 s on the CPU). Safe to call twice. Call it on
        the event loop the engine runs on, while that loop runs (see the end of this method).

        ``timeout`` bounds the wait for the engine core to exit before it is killed. vLLM's own
        default (5 s) is shorter than the CPU engine core takes to stop its worker (4-5 s), so it
        killed the core, whose shared memory was then left for the resource tracker to unlink.
        """
        llm, self._llm = self._llm, None
        if llm is None:
            return
        llm.shutdown(timeout=timeout)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        # vLLM closes its client sockets but never terminates their ZMQ context: left to the
        # garbage collector, it keeps two I/O threads until then and warns (ResourceWarning).
        # (vLLM closes its asyncio sockets on their event loop: called from outside a running
        # loop, they stay open and this waits for them for ever.)
        resources = getattr(llm.engine_core, "resources", None)
        context = getattr(resources, "ctx", None)
        if context is not None and not context.closed:
            context.destroy(linger=0)


async def _run_in_thread(fn: Callable[[], _T], name: str) -> _T:
    """Run blocking ``fn`` in a named thread; if the waiter is cancelled, shut down its result."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def deliver(result: _T | None, error: BaseException | None) -> None:
        if done.cancelled():
            if error is None and hasattr(result, "shutdown"):
                # Nobody will use this engine: release its processes, off the event loop.
                threading.Thread(target=result.shutdown, name=f"{name}-discard").start()
        elif error is None:
            done.set_result(result)  # type: ignore[arg-type]
        else:
            done.set_exception(error)

    def target() -> None:
        result: _T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is waiting
            loop.call_soon_threadsafe(deliver, result, error)
        # Hold no reference here: only the waiter (or deliver's shutdown) owns the engine.
        del result, error

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done
