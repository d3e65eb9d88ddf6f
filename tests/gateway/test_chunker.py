"""gateway.chunker: exact 200 ms chunks whatever the input chunking, remainder on flush."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.chunker import Chunker
from stages.messages import CHUNK_SAMPLES


def test_chunk_is_200_ms_at_16_khz() -> None:
    assert CHUNK_SAMPLES == 16_000 * 200 // 1000


@pytest.mark.parametrize("piece", [1, 320, 999, 3_200, 7_001])
def test_chunks_reassemble_the_stream(piece: int) -> None:
    stream = np.random.default_rng(piece).integers(-32768, 32767, 20_000, dtype=np.int16)
    chunker = Chunker()
    chunks = []
    for pos in range(0, len(stream), piece):
        chunks += chunker.push(stream[pos : pos + piece])
    assert all(len(c) == CHUNK_SAMPLES and c.dtype == np.int16 for c in chunks)
    assert len(chunks) == len(stream) // CHUNK_SAMPLES
    assert chunker.pending == len(stream) % CHUNK_SAMPLES
    tail = chunker.flush()
    assert tail is not None and len(tail) == len(stream) % CHUNK_SAMPLES
    np.testing.assert_array_equal(np.concatenate([*chunks, tail]), stream)
    assert chunker.pending == 0 and chunker.flush() is None


def test_returned_chunks_are_not_reused() -> None:
    chunker = Chunker(chunk_samples=4)
    first = chunker.push(np.arange(4, dtype=np.int16))[0]
    chunker.push(np.full(4, 9, np.int16))
    np.testing.assert_array_equal(first, [0, 1, 2, 3])


def test_twenty_ms_frames_make_a_chunk_every_tenth_frame() -> None:
    chunker = Chunker()
    produced = [len(chunker.push(np.zeros(320, np.int16))) for _ in range(30)]
    assert produced == [0] * 9 + [1] + [0] * 9 + [1] + [0] * 9 + [1]


def test_reset_drops_the_pending_audio() -> None:
    chunker = Chunker()
    chunker.push(np.ones(1000, np.int16))
    chunker.reset()
    assert chunker.pending == 0 and chunker.flush() is None
    with pytest.raises(ValueError, match="chunk_samples"):
        Chunker(0)
