"""A gateway process's routing of stage events to its sessions, with stand-ins for the rings
and the sessions."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from gateway.calls import Gateway
from gateway.config import load_config
from stages.envelope import Envelope
from stages.messages import CancelAck, Kind, TextDelta
from stages.rings import RingNames
from tests.stages.stage_events import Epochs

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


class Link:
    def __init__(self, epoch: int) -> None:
        self.control = Epochs(epoch)


class Owner:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_stage_event(self, event: Envelope) -> None:
        self.events.append(event.msg)


def test_records_a_cancel_made_stale_on_their_way_to_the_loop_are_dropped() -> None:
    """The ring drops records of a cancelled epoch; one popped just before the cancel is still
    dropped when the loop comes to it, unless it is one that must always arrive (an ack)."""
    gateway = Gateway(load_config(TINY), RingNames.fresh(), 22050, lambda: True)
    gateway.link = Link(epoch=4)  # type: ignore[assignment]
    owner = gateway.by_session[3] = Owner()  # type: ignore[assignment]
    stale, fresh = TextDelta("resp_1", "old", 0), TextDelta("resp_2", "new", 0)
    ack = CancelAck(1, "vocoder", 0)
    for epoch, kind, msg in [
        (3, Kind.TEXT_DELTA, stale),
        (3, Kind.CANCEL_ACK, ack),
        (4, Kind.TEXT_DELTA, fresh),
    ]:
        gateway._route(Envelope("reasoning", kind, 3, epoch, 0, 0, msg))
    assert owner.events == [ack, fresh]


async def test_an_observer_sees_each_record_on_the_reader_thread_before_it_is_routed() -> None:
    gateway = Gateway(load_config(TINY), RingNames.fresh(), 22050, lambda: True)
    gateway.loop = asyncio.get_running_loop()
    gateway.link = Link(epoch=0)  # type: ignore[assignment]
    owner = gateway.by_session[3] = Owner()  # type: ignore[assignment]
    observed: list[tuple[Envelope, list[Any], str]] = []
    gateway.add_stage_observer(
        lambda event: observed.append((event, list(owner.events), threading.current_thread().name))
    )
    delta = Envelope("reasoning", Kind.TEXT_DELTA, 3, 0, 7, 5, TextDelta("resp_1", "hi", 0))
    reader = threading.Thread(target=gateway._on_stage_event, args=(delta,), name="link<-test")
    reader.start()
    reader.join()
    assert observed == [(delta, [], "link<-test")]  # its envelope whole, nothing routed yet
    await asyncio.sleep(0)  # the hop to the loop
    assert owner.events == [delta.msg]


async def test_an_observer_that_raises_is_logged_and_the_record_still_routed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gateway = Gateway(load_config(TINY), RingNames.fresh(), 22050, lambda: True)
    gateway.loop = asyncio.get_running_loop()
    gateway.link = Link(epoch=0)  # type: ignore[assignment]
    owner = gateway.by_session[3] = Owner()  # type: ignore[assignment]
    after: list[Envelope] = []

    def broken(event: Envelope) -> None:
        raise RuntimeError("observer broke")

    gateway.add_stage_observer(broken)
    gateway.add_stage_observer(after.append)
    delta = Envelope("reasoning", Kind.TEXT_DELTA, 3, 0, 7, 5, TextDelta("resp_1", "hi", 0))
    await asyncio.to_thread(gateway._on_stage_event, delta)
    await asyncio.sleep(0)
    assert owner.events == [delta.msg] and after == [delta]
    assert "stage observer" in caplog.text and "TEXT_DELTA" in caplog.text
    assert "observer broke" in caplog.text
