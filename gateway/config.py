"""The YAML configuration of `omni-gateway start`: the pipeline's stages plus the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from stages.config import PipelineConfig, Strict


class GatewayConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class OmniConfig(PipelineConfig):
    """A whole deployment, as written in configs/*.yaml."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)


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
    for dotted, value in (overrides or {}).items():
        node = data = data if isinstance(data, dict) else {}
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_config(data, str(path))
