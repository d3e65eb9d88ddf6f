from __future__ import annotations

from collections.abc import Iterator

import pytest

from shm import Control, Ring, segment_name


@pytest.fixture
def control() -> Iterator[Control]:
    with Control.create(segment_name("test-ctl"), 64) as ctl:
        yield ctl


@pytest.fixture
def ring(control: Control) -> Iterator[Ring]:
    with Ring.create(segment_name("test-ring"), 4096, control=control) as r:
        yield r
