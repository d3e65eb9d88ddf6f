"""Config settings varied from the command line: `--set KEY=V1,V2`, each a dimension of
variants whose every combination a benchmark runs, and the config overrides of one choice."""

from __future__ import annotations

import argparse
from typing import Any


def setting_overrides(settings: Any) -> dict[str, Any]:
    """Config overrides from `--set` choices, (KEY, VALUE) each: "a.b+c.d" keys both take the
    value, or one part each of a value of as many parts (parse_setting)."""
    overrides: dict[str, Any] = {}
    for keys, value in settings:
        names = keys.split("+")
        values = value if isinstance(value, tuple) else (value,) * len(names)
        overrides |= dict(zip(names, values, strict=True))
    return overrides


def parse_setting(text: str) -> list[tuple[str, Any]]:
    """`--set KEY=V1,V2`: one dimension of variants, KEY set to each value (YAML scalars).
    KEY may name several keys joined by "+", which take each value together, or one part
    each of a value joined by "+" as many times (`a.b+c.d=200+3,120+2`)."""
    import yaml

    key, sep, values = text.partition("=")
    keys = key.split("+")
    if not sep or not values or not all(all(k.split(".")) for k in keys):
        raise argparse.ArgumentTypeError(
            f"--set {text!r}: KEY[+KEY...]=VALUE[,VALUE...], e.g. "
            "reasoning.sampling.max_tokens=400,60"
        )
    out: list[tuple[str, Any]] = []
    for value in values.split(","):
        parts = value.split("+")
        if len(keys) > 1 and len(parts) == len(keys):
            out.append((key, tuple(yaml.safe_load(v) for v in parts)))
        elif len(parts) > 1 and len(keys) > 1:
            raise argparse.ArgumentTypeError(
                f"--set {text!r}: {value!r} has {len(parts)} parts for {len(keys)} keys"
            )
        else:
            out.append((key, yaml.safe_load(value)))
    return out


def add_set_argument(parser: argparse.ArgumentParser, example: str) -> None:
    """`--set KEY=V1,V2`, repeatable, parsed into a list of dimensions (parse_setting)."""
    parser.add_argument(
        "--set",
        type=parse_setting,
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help=f"any config key's variants, e.g. --set {example} (repeatable: every "
        "combination runs)",
    )
