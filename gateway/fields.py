"""Checking what a client sends, field by field: the error that names the field, and the
checks every part of the Realtime protocol shares."""

from __future__ import annotations

from typing import Any

# one text a client gives (instructions, an item's text): it travels to the reasoning stage in
# one ring record (512 KiB), beside the history; longer than any prompt a voice agent needs
MAX_TEXT_BYTES = 128 * 1024


class ProtocolError(ValueError):
    """A client event we cannot carry out; becomes an `error` event naming `param`."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def unsupported(param: str, why: str) -> ProtocolError:
    return ProtocolError(f"{param} is not supported here: {why}", param=param, code="unsupported")


def mapping(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{param} must be an object", param=param)
    return value


def check_keys(value: dict[str, Any], allowed: set[str], param: str) -> None:
    for key in value:
        if key not in allowed:
            raise ProtocolError(f"unknown field {param}.{key}", param=f"{param}.{key}")


def text_field(value: Any, param: str) -> str:
    """A client's text, at most MAX_TEXT_BYTES of UTF-8."""
    if not isinstance(value, str):
        raise ProtocolError(f"{param} must be a string", param=param)
    if len(value) > MAX_TEXT_BYTES // 4 and len(value.encode("utf-8")) > MAX_TEXT_BYTES:
        raise ProtocolError(
            f"{param} is longer than {MAX_TEXT_BYTES // 1024} KiB of UTF-8",
            param=param,
            code="text_too_long",
        )
    return value
