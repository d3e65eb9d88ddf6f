"""How the callers' clock readings are joined with the ring records' stamps into hops,
cancels and inter-token intervals. Records are made up with known times."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.latency import (
    HOPS,
    cancel_latencies,
    inter_token_ms,
    load_figures,
    turn_hops,
    voice_before_start,
)
from loadtest.tap import Seen
from stages.messages import CancelAck, Kind, Phrase, ResponseStarted, TextDelta, Transcript

MS = 1_000_000


HOPS_NAMES = [name for name, _, _ in HOPS]


def seen(t_ms: float, stage: str, kind: Kind, msg, call="call-a", sent=None) -> Seen:
    t = int(t_ms * MS)
    return Seen(t + 1, call, 1, stage, kind, t, msg, sent)


def one_turn() -> tuple[list[dict], list[Seen]]:
    """A caller stops speaking at 1000 ms and hears the agent at 1900 ms."""
    reports = [
        {
            "call_id": "call-a",
            "error": None,
            "turns": [{"onset": 0.0, "end_of_speech": 1.0, "first_audio": 1.9}],
        }
    ]
    records = [
        # an earlier turn of the same call, before this end of speech: not this turn's
        seen(500, "encoder", Kind.TRANSCRIPT, Transcript(1, "x", True, True, int(400 * MS))),
        seen(
            1560,
            "encoder",
            Kind.TRANSCRIPT,
            Transcript(2, "hi", True, True, int(1500 * MS), decode_ns=int(40 * MS)),
        ),
        seen(1561, "reasoning", Kind.RESPONSE_STARTED, ResponseStarted("r2", 2)),
        seen(1580, "reasoning", Kind.TEXT_DELTA, TextDelta("r2", "a", 0, int(15 * MS))),
        seen(1585, "reasoning", Kind.TEXT_DELTA, TextDelta("r2", " b", 1)),
        seen(1595, "reasoning", Kind.TEXT_DELTA, TextDelta("r2", " c", 2)),
        seen(1600, "vocoder", Kind.PHRASE, Phrase("r2", "a b c", 16000, int(1595 * MS))),
        seen(1700, "vocoder", Kind.AUDIO_OUT, None),
        seen(1800, "vocoder", Kind.AUDIO_OUT, None),
    ]
    return reports, records


def test_a_turn_is_split_into_its_hops() -> None:
    (hops,) = turn_hops(*one_turn())
    assert hops == pytest.approx(
        {
            "turn": 900,
            "to_first_token": 580,  # end of speech to the first token, whatever came between
            "vad_decision": 500,
            "encoder": 60,
            "first_token": 20,
            "first_phrase": 20,
            "first_audio_chunk": 100,
            "playout": 200,
            # decode 40 + first token 15 + words of the first phrase 15 + first chunk 100
            "model": 170,
            "overhead_vad_decision": 500,
            "overhead_encoder": 20,
            "overhead_first_token": 5,
            "overhead_first_phrase": 5,
            "overhead_first_audio_chunk": 0,
            "overhead_playout": 200,
        }
    )
    split = sum(hops[h] for h in HOPS_NAMES)
    assert split == pytest.approx(hops["turn"])
    overhead = sum(hops[f"overhead_{h}"] for h in HOPS_NAMES)
    assert overhead == pytest.approx(hops["turn"] - hops["model"])


def test_a_turn_whose_transcript_never_came_is_timed_to_the_reply_heard() -> None:
    """Speech-in: the reply is made from the audio's rows, and the transcript may come after
    the call ended; the first token is still the answering reply's."""
    reports, records = one_turn()
    records = [r for r in records if r.kind is not Kind.TRANSCRIPT]
    (hops,) = turn_hops(reports, records)
    assert hops == pytest.approx({"turn": 900, "to_first_token": 580})


def test_load_figures_subtract_the_vad_window_and_time_tokens() -> None:
    figures = load_figures(*one_turn(), silence_ms=500)
    assert figures["turn_ms"]["p50"] == 900
    assert figures["turn_beyond_vad_window_ms"]["p95"] == 400
    assert figures["pipeline_overhead_ms"]["p50"] == pytest.approx(400 - 170)
    assert figures["overhead_by_hop_ms"]["vad_decision"]["p50"] == 0  # all of it the window
    assert figures["overhead_by_hop_ms"]["playout"]["p50"] == 200
    assert figures["inter_token_ms_during_calls"]["n"] == 2
    assert figures["turns_answered"] == figures["turns_asked"] == 1
    assert figures["voice_before_start"] == {"replies_spoken": 1, "voice_first": 0}
    assert "turns" not in figures  # percentiles only, unless asked

    (turn,) = load_figures(*one_turn(), silence_ms=500, per_turn=True)["turns"]
    assert turn["turn"] == 900 and turn["playout"] == 200


def test_a_phrase_read_before_its_replys_start_is_counted() -> None:
    records = one_turn()[1]
    # the reply's start read by its reader thread after the vocoder's first phrase was
    started = next(r for r in records if r.kind is Kind.RESPONSE_STARTED)
    records.remove(started)
    records.append(dataclasses.replace(started, recv_ns=int(1601 * MS)))
    records.sort(key=lambda r: r.recv_ns)
    assert voice_before_start(records) == {"replies_spoken": 1, "voice_first": 1}


def test_cancel_latency_is_to_the_last_of_three_acks() -> None:
    sent = 10 * MS
    acks = [
        seen(11, "gateway", Kind.CANCEL_ACK, CancelAck(7, stage, int(t * MS)), sent=sent)
        for stage, t in (("encoder", 11), ("vocoder", 12), ("reasoning", 15))
    ]
    # a cancel only two stages answered has no last ack
    acks.append(
        seen(30, "gateway", Kind.CANCEL_ACK, CancelAck(8, "encoder", 31 * MS), sent=30 * MS)
    )
    out = cancel_latencies(acks)
    assert out["last_ack"] == [pytest.approx(5.0)]
    assert out["reasoning"] == [pytest.approx(5.0)] and out["encoder"] == [1.0, 1.0]


def test_inter_token_intervals_are_per_reply() -> None:
    records = [
        seen(t, "reasoning", Kind.TEXT_DELTA, TextDelta(rid, "x", 0))
        for rid, t in (("a", 0), ("b", 1), ("a", 5), ("b", 7), ("a", 9))
    ]
    assert sorted(inter_token_ms(records)) == pytest.approx([4, 5, 6])
    assert sorted(inter_token_ms(records, {"b"})) == pytest.approx([6])
