"""Function calling on vLLM's own machinery, for one reply: the request vLLM's OpenAI server
would build for it (a ``ChatCompletionRequest``), adjusted by the model family's tool parser
(``tool_choice`` "required" or a named function become a JSON schema for structured outputs,
so that every model, a random-weight one included, yields a valid call), and the parser's
streaming split of what the model writes into words to speak and calls with their arguments.

The reasoning stage asks `ToolCalls.feed` after each piece of output; what comes back is in
the order the model wrote it. `finish` checks each call against the tools (its name one of
them, its arguments a JSON object) and returns the good calls and the bad.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.messages import BadToolCall, Tool, ToolCall, Tools

if TYPE_CHECKING:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.abstract_parser import Parser

logger = logging.getLogger(__name__)


_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class Words:
    """Text the reply says (content, spoken)."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    delta: str


Piece = Words | CallStarted | CallArguments


class ToolParserError(ValueError):
    """The configured tool parser is not one vLLM has."""


def chat_tools(tools: Tools) -> list[dict[str, Any]]:
    """The tools in the Chat Completions form chat templates render."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": json.loads(tool.parameters),
            },
        }
        for tool in tools.tools
    ]


def parser_class(name: str, tokenizer: Any, strict: str = "parameter") -> type[Parser]:
    """vLLM's parser for the tool-call format `name` (vLLM's --tool-call-parser names).
    `strict` is vLLM's --tool-strict-level: "parameter" constrains every call the model
    starts to a tool's name and its arguments to that tool's schema (the formats vLLM has a
    structural tag for, hermes among them), "function" the name only, "auto" leaves "auto"
    calls free."""
    try:
        from vllm.parser.parser_manager import ParserManager
        from vllm.tool_parsers import ToolParserManager
    except ImportError as exc:
        raise ToolParserError(
            "function calling needs vLLM's unified parsers (vllm.parser, vLLM 0.32 and "
            f"later); this vLLM has none: {exc}"
        ) from None

    known = ToolParserManager.list_registered()
    if name not in known:
        raise ToolParserError(f"no vLLM tool parser {name!r}; vLLM has {', '.join(known)}")
    parser = ParserManager.get_parser(
        tool_parser_name=name, enable_auto_tools=True, tool_strict_level=strict, tokenizer=tokenizer
    )
    assert parser is not None
    return parser


class ToolCalls:
    """One reply's function calling: what to ask vLLM for, and its output split up."""

    def __init__(
        self,
        tools: Tools,
        messages: list[dict[str, Any]],
        parser: type[Parser],
        tokenizer: Any,
    ) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.tools = tools
        self.names = {tool.name for tool in tools.tools}
        # one function the reply must call (named, or the only tool under "required"): the
        # model writes only its arguments, a third of the tokens of the call in its format
        self.only: Tool | None = None
        if tools.choice == "function" or (tools.choice == "required" and len(tools.tools) == 1):
            wanted = tools.function or tools.tools[0].name
            self.only = next(t for t in tools.tools if t.name == wanted)
        self._parser: Parser | None = None
        self.request: ChatCompletionRequest | None = None
        if self.only is None:  # the model writes calls in its format: vLLM's parser reads them
            request = ChatCompletionRequest(
                messages=messages,
                tools=chat_tools(tools),
                tool_choice=tools.choice,
                parallel_tool_calls=tools.parallel,
            )
            self._parser = parser(tokenizer, request.tools)
            self.request = self._parser.adjust_request(request)
        self._calls: list[dict[str, str]] = []  # by index: call_id, name, arguments
        self._announced: set[int] = set()  # indexes whose CallStarted went out
        # the one call a reply must make is written whole: what the model writes after its
        # JSON (a model that does not stop, or sampling that ignores its end) is no part of it
        self.whole = False

    @property
    def calling(self) -> bool:
        """The model has begun a call: what it writes now is a call's, not words."""
        return bool(self._calls)

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields the parser asked for: the JSON schema a required or named
        call must follow, and the special tokens some formats mark calls with."""
        from vllm.sampling_params import StructuredOutputsParams

        if self.only is not None:
            schema = {"type": "json_schema", "json_schema": json.loads(self.only.parameters)}
            tag = _compact({"type": "structural_tag", "format": schema})
            return {"structured_outputs": StructuredOutputsParams(structural_tag=json.dumps(tag))}
        assert self.request is not None
        extra: dict[str, Any] = {"skip_special_tokens": self.request.skip_special_tokens}
        constraint = self.request.structured_outputs
        if constraint is not None:
            if constraint.structural_tag is not None:
                tag = _compact(json.loads(constraint.structural_tag))
                constraint = dataclasses.replace(constraint, structural_tag=json.dumps(tag))
            extra["structured_outputs"] = constraint
        return extra

    def feed(self, text: str, token_ids: Sequence[int], finished: bool = False) -> list[Piece]:
        """What one piece of the model's output says: words, calls begun, arguments."""
        if self.only is not None:
            return self._arguments(text)
        assert self._parser is not None
        delta = self._parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self.request,
            prompt_token_ids=[],  # no reasoning parser: the output is answer from the start
            finished=finished,
        )
        if delta is None:
            return []
        pieces: list[Piece] = []
        if delta.content:
            pieces.append(Words(delta.content))
        for call in delta.tool_calls or []:
            pieces += self._call_delta(call)
        return pieces

    def _arguments(self, text: str) -> list[Piece]:
        """The output of a reply that must call `only`: its arguments, nothing else."""
        assert self.only is not None
        pieces: list[Piece] = []
        if not self._calls:
            self._calls.append(
                {
                    "call_id": f"call_{uuid.uuid4().hex[:24]}",
                    "name": self.only.name,
                    "arguments": "",
                }
            )
            self._announced.add(0)
            pieces.append(CallStarted(0, self._calls[0]["call_id"], self.only.name))
        if text and not self.whole:
            before = self._calls[0]["arguments"]
            written = before + text
            start = len(written) - len(written.lstrip())
            try:
                _, end = _JSON.raw_decode(written, start)
            except ValueError:  # not whole yet
                pass
            else:
                self.whole = True
                text = written[len(before) : end]
            self._calls[0]["arguments"] += text
            if text:
                pieces.append(CallArguments(0, text))
        return pieces

    def _call_delta(self, call: Any) -> list[Piece]:
        index = call.index
        while len(self._calls) <= index:
            self._calls.append({"call_id": "", "name": "", "arguments": ""})
        held = self._calls[index]
        function = call.function
        name = getattr(function, "name", None) if function is not None else None
        arguments = getattr(function, "arguments", None) if function is not None else None
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
        pieces: list[Piece] = []
        if name and not held["name"]:
            held["name"] = name
            held["call_id"] = call.id or f"call_{uuid.uuid4().hex[:24]}"
        if held["name"] and index not in self._announced and self._may_call(index):
            self._announced.add(index)
            pieces.append(CallStarted(index, held["call_id"], held["name"]))
            if held["arguments"]:  # arguments that came before the name
                pieces.append(CallArguments(index, held["arguments"]))
        if arguments:
            held["arguments"] += arguments
            if index in self._announced:
                pieces.append(CallArguments(index, arguments))
        return pieces

    def _may_call(self, index: int) -> bool:
        """A call is announced only if it names a tool and, with parallel calls off, is the
        first: the others are reported bad at the end."""
        return self._calls[index]["name"] in self.names and (self.tools.parallel or index == 0)

    def finish(self) -> tuple[list[ToolCall], list[BadToolCall]]:
        """The calls the reply made, checked: (good, bad)."""
        good: list[ToolCall] = []
        bad: list[BadToolCall] = []
        for index, held in enumerate(self._calls):
            name, arguments = held["name"], held["arguments"].strip() or "{}"
            reason = _fault(name, arguments, self.names)
            if reason is None and index not in self._announced:
                reason = "parallel_tool_calls is false: only the first call is made"
            if reason is None:
                good.append(ToolCall(held["call_id"], name, arguments))
            else:
                bad.append(BadToolCall(index, name, held["arguments"], reason))
        return good, bad


def _compact(node: Any) -> Any:
    """A structural tag whose JSON allows no runs of whitespace: JSON's grammar allows any
    amount between tokens, and a model that is unsure (a small one, a random one) can spend
    its whole token budget on it, the call never closed. Arguments stay JSON all the same."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and node.get("max_whitespace_cnt") is None:
            node["max_whitespace_cnt"] = 1
        for value in node.values():
            _compact(value)
    elif isinstance(node, list):
        for value in node:
            _compact(value)
    return node


def _fault(name: str, arguments: str, names: set[str]) -> str | None:
    if not name:
        return "the call names no function"
    if name not in names:
        return f"the model called {name!r}, which is not one of the tools"
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        return f"its arguments are not JSON ({exc})"
    if not isinstance(value, dict):
        return "its arguments are not a JSON object"
    return None


BUILTIN_TEMPLATES = {"builtin:chatml-hermes": "chatml_tools.jinja"}


class ToolTemplateError(ValueError):
    """No chat template that renders tools could be found for the model."""


def tool_chat_template(setting: str | None, model_template: str | None) -> str | None:
    """The chat template to render a prompt with tools: the configured one (a built-in name
    or a file), else None for the model's own when it renders tools, else the built-in
    ChatML one for a ChatML model. Raises ToolTemplateError naming what to set."""
    if setting is None:
        if model_template and "tools" in model_template:
            return None
        if model_template and "<|im_start|>" in model_template:
            logger.info("the model's chat template renders no tools: using builtin:chatml-hermes")
            setting = "builtin:chatml-hermes"
        else:
            raise ToolTemplateError(
                "the model's chat template renders no tools: set reasoning.tools.chat_template "
                "to a template that does"
            )
    if setting in BUILTIN_TEMPLATES:
        return (Path(__file__).parent / "templates" / BUILTIN_TEMPLATES[setting]).read_text()
    if setting.startswith("builtin:"):
        raise ToolTemplateError(
            f"no built-in chat template {setting!r}; there is {', '.join(BUILTIN_TEMPLATES)}"
        )
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ToolTemplateError(f"reasoning.tools.chat_template {setting!r} is not a file")
    return path.read_text()
