"""The gateway's stage-record trace: what reader threads write is what a reader gets back."""

from __future__ import annotations

import threading

from gateway.trace import StageTrace, read_trace
from stages.envelope import Envelope
from stages.messages import CancelAck, Kind, TextDelta, Transcript


def event(kind: Kind, msg: object, session: int = 3, t_ns: int = 1) -> Envelope:
    return Envelope("reasoning", kind, session, epoch=0, seq=0, t_ns=t_ns, msg=msg)


def test_entries_from_several_threads_read_back_whole(tmp_path) -> None:
    trace = StageTrace(tmp_path / "gateway.trace")

    def write(session: int) -> None:
        for i in range(200):
            delta = TextDelta("resp", f"w{i}", i)
            trace.record(event(Kind.TEXT_DELTA, delta, session, t_ns=i), f"rtc_{session}")

    threads = [threading.Thread(target=write, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trace.record(event(Kind.AUDIO_OUT, memoryview(b"\x01\x02" * 800)), "rtc_0")
    ack = CancelAck(7, "vocoder", 123)
    trace.record(event(Kind.CANCEL_ACK, ack), "rtc_0", cancel_sent_ns=99)
    trace.close()

    entries = list(read_trace(tmp_path / "gateway.trace"))
    assert len(entries) == 4 * 200 + 2
    for s in range(4):
        mine = [e for e in entries[:-2] if e.call_id == f"rtc_{s}"]
        assert [e.msg.index for e in mine] == list(range(200))  # in order, none torn
        assert all(e.kind == Kind.TEXT_DELTA and e.session == s for e in mine)
    audio, acked = entries[-2:]
    assert audio.kind == Kind.AUDIO_OUT and audio.payload == b"" and audio.msg is None
    assert acked.msg == ack and acked.cancel_sent_ns == 99
    # a mark in time leaves out what came before it
    assert list(read_trace(tmp_path / "gateway.trace", since_ns=acked.recv_ns)) == [acked]


def test_an_entry_cut_short_is_left_out(tmp_path) -> None:
    path = tmp_path / "gateway.trace"
    trace = StageTrace(path)
    final = Transcript(1, "hello", final=True)
    trace.record(event(Kind.TRANSCRIPT, final), "rtc_a")
    trace.record(event(Kind.TRANSCRIPT, final), "rtc_b")
    trace.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # a process killed mid-write
    assert [e.call_id for e in read_trace(path)] == ["rtc_a"]
    # and records arriving after close (a reader thread still delivering) are dropped quietly
    trace.record(event(Kind.TRANSCRIPT, final), "rtc_c")


def test_a_full_disk_ends_the_trace_not_the_reader(caplog) -> None:
    trace = StageTrace("/dev/full")  # every write fails with ENOSPC
    final = Transcript(1, "hello", final=True)
    trace.record(event(Kind.TRANSCRIPT, final), "rtc_a")  # no exception for the reader thread
    trace.record(event(Kind.TRANSCRIPT, final), "rtc_a")
    assert [r.message for r in caplog.records if "stopped" in r.message] == [
        "stage trace /dev/full stopped: [Errno 28] No space left on device"
    ]
    trace.close()
