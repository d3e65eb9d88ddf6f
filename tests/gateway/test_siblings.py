"""Which gateway process a request belongs to, from the shared control segment's session ids."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.siblings import FORWARDED, Siblings, call_id, gateway_of_call
from shm import Control, segment_name
from stages.rings import RingNames


def request(**headers: str) -> SimpleNamespace:
    return SimpleNamespace(headers=headers)


def test_call_ids_name_their_process() -> None:
    assert gateway_of_call(call_id("rtc", 3)) == 3
    assert gateway_of_call(call_id("sess", 0)) == 0
    assert gateway_of_call("rtc_0123456789abcdef") is None  # not one of ours


def test_new_calls_go_to_the_least_loaded_process_once() -> None:
    names = RingNames.fresh({"gateway": 3})
    with Control.create(segment_name("test-siblings"), 12) as control:
        here = Siblings(names, "gateway", control, "/nonexistent")
        assert here.target_for_new_call(request()) is None  # all empty: keep it
        control.open_session(0, 3)
        control.open_session(0, 3)  # two sessions here
        control.open_session(1, 3)  # one on gateway.1, none on gateway.2
        assert [here.load(g) for g in names.gateways] == [2, 1, 0]
        assert here.target_for_new_call(request()) == "gateway.2"
        assert here.target_for_new_call(request(**{FORWARDED: "gateway.1"})) is None
        other = Siblings(names, "gateway.2", control, "/nonexistent")
        assert other.target_for_new_call(request()) is None  # the least loaded keeps it

        assert here.holder_of_call(call_id("rtc", 1), request()) == "gateway.1"
        assert here.holder_of_call(call_id("rtc", 0), request()) is None  # its own
        assert here.holder_of_call(call_id("rtc", 7), request()) is None  # no such process
        forwarded = request(**{FORWARDED: "gateway.2"})
        assert here.holder_of_call(call_id("rtc", 1), forwarded) is None  # never twice
