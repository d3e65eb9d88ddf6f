"""The tap on the gateway under test: a Tap on this process's gateway, as its stage observer,
and the traces of other gateway processes read as one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.calls import Gateway
from gateway.config import load_config
from gateway.trace import StageTrace
from loadtest.tap import Tap, Traces
from stages.envelope import Envelope
from stages.messages import Kind, ResponseDone, TextDelta
from stages.rings import RingNames

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


async def test_a_tap_keeps_what_the_gateway_receives_and_wakes_who_waits_for_a_reply() -> None:
    gateway = Gateway(load_config(TINY), RingNames.fresh(), 22050, lambda: True)
    gateway.loop = asyncio.get_running_loop()
    tap = Tap(gateway)
    tap.install()
    done = tap.expect_done("resp_1")
    mark = tap.mark()
    finished = ResponseDone("resp_1", "completed", "hi")
    records = [
        Envelope("reasoning", Kind.TEXT_DELTA, 3, 0, 0, 5, TextDelta("resp_1", "hi", 0)),
        Envelope("vocoder", Kind.AUDIO_OUT, 3, 0, 0, 6, b"\0\0"),
        Envelope("reasoning", Kind.RESPONSE_DONE, 3, 0, 1, 9, finished),
    ]
    for event in records:  # on a thread of their own, as the ring readers hand them on
        await asyncio.to_thread(gateway._on_stage_event, event)
    await asyncio.wait_for(done, 5)
    seen = tap.since(mark)
    assert [(s.stage, s.kind, s.session, s.t_ns) for s in seen] == [
        ("reasoning", Kind.TEXT_DELTA, 3, 5),
        ("vocoder", Kind.AUDIO_OUT, 3, 6),
        ("reasoning", Kind.RESPONSE_DONE, 3, 9),
    ]
    assert seen[0].msg == records[0].msg and seen[1].msg is None  # audio is not kept
    assert seen[0].call_id is None  # no call holds session 3


def test_traces_of_every_gateway_process_are_read_as_one_tap(tmp_path: Path) -> None:
    def event(session: int, index: int) -> Envelope:
        delta = TextDelta("r", "w", index)
        return Envelope("reasoning", Kind.TEXT_DELTA, session, 0, 0, index, delta)

    first, second = StageTrace(tmp_path / "gateway.trace"), StageTrace(tmp_path / "gateway.1.trace")
    first.record(event(0, 0), "rtc_g0_a")
    traces = Traces(tmp_path)
    mark = traces.mark()
    for i in range(3):
        second.record(event(1, i), "rtc_g1_b")
        first.record(event(0, i + 1), "rtc_g0_a")
    first.close()
    second.close()
    seen = traces.since(mark)
    assert [s.recv_ns for s in seen] == sorted(s.recv_ns for s in seen)
    assert [(s.call_id, s.msg.index) for s in seen[:2]] == [("rtc_g1_b", 0), ("rtc_g0_a", 1)]
    assert traces.by_process == {"gateway": 3, "gateway.1": 3}  # not the one before the mark
    assert all(s.kind is Kind.TEXT_DELTA for s in seen)
