"""Suite-wide guards: no test may leave a shared-memory segment behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shm import list_segments


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = set(list_segments())
    yield
    leaked = set(list_segments()) - before
    assert not leaked, f"test left shared-memory segments behind: {sorted(leaked)}"
