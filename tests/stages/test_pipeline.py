"""The three stages end to end: real processes, real rings, vLLM on the tiny model, pocketsphinx
and espeak-ng. One supervisor serves the module (vLLM takes ~20 s to start). Stages killed
under a served gateway are tests/gateway/test_faults.py's."""

from __future__ import annotations

import difflib
import threading
import time

import numpy as np
import pytest

from stages.backends.asr_pocketsphinx import load_pocketsphinx
from stages.driver import TurnResult, collect_reply, speak_turn
from stages.envelope import Envelope
from stages.link import EventQueues, PipelineLink
from stages.messages import Kind
from tests.stages.conftest import tiny_with_long_replies
from tests.stages.stage_events import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SENTENCE = "what is the weather like today in paris"


@pytest.fixture(scope="module")
def config():
    return tiny_with_long_replies()


def drain(events: EventQueues, session: int) -> list[Envelope]:
    q, out = events.queue(session), []
    while not q.empty():
        out.append(q.get())
    return out


def wait_acks(
    events: EventQueues, session: int, cancel_id: int, timeout: float = 10
) -> dict[str, Envelope]:
    acks: dict[str, Envelope] = {}
    deadline = time.monotonic() + timeout
    while len(acks) < 3:
        ev = events.next(session, max(0.01, deadline - time.monotonic()))
        if ev.kind is Kind.CANCEL_ACK and ev.msg.cancel_id == cancel_id:
            acks[ev.msg.stage] = ev
    return acks


def test_spoken_turn_streams_text_and_audio(
    link: PipelineLink, events: EventQueues, make_speech
) -> None:
    speech = make_speech(SENTENCE)
    session = link.open_session()
    try:
        result = speak_turn(link, events, session, speech.pcm16)
    finally:
        link.close_session(session)

    # pocketsphinx is weak on synthetic speech: compare with the same file decoded directly
    stream = load_pocketsphinx().open_stream()
    stream.feed(speech.pcm16)
    direct = stream.finish()
    similarity = difflib.SequenceMatcher(None, result.transcript.split(), direct.split()).ratio()
    print(f"\npipeline heard {result.transcript!r}; direct decode {direct!r}")
    assert result.transcript and similarity >= 0.8

    deltas = [e for e in result.events if e.kind is Kind.TEXT_DELTA]
    assert len(deltas) >= 5 and result.reply_text == "".join(e.msg.text for e in deltas)
    # the first audio came while the reply was still being generated
    assert result.t_ns["first_audio"] < result.t_ns["response_done"]
    audio = result.pcm16
    assert result.sample_rate == 22050 and len(audio) > result.sample_rate  # over a second
    assert np.abs(audio.astype(np.int32)).mean() > 100  # speech, not silence
    chunks = [e for e in result.events if e.kind is Kind.AUDIO_OUT]
    assert max(len(c.msg) // 2 for c in chunks) <= result.sample_rate // 10  # <= 100 ms each
    print("hops (ms):", {k: round(v, 1) for k, v in result.hops_ms().items()})


def test_cancel_mid_reply_purges_every_stage(
    link: PipelineLink, events: EventQueues, make_speech
) -> None:
    speech = make_speech(SENTENCE)
    session = link.open_session()
    try:
        link.create_response(session, "resp_long", text="tell me a long story")
        wait_for(events, session, Kind.AUDIO_OUT)
        old_epoch = link.control.epoch(session)
        cancel_id, t_cancel = link.cancel(session, "resp_long", spoken_text="Once upon")
        acks = wait_acks(events, session, cancel_id)
        assert set(acks) == {"encoder", "reasoning", "vocoder"}
        assert all(a.msg.t_ns >= t_cancel for a in acks.values())
        # the reply's KV blocks were freed: nothing else is running, so usage is back to 0
        assert acks["reasoning"].msg.kv_usage == 0.0
        print(
            f"\ncancel -> last ack {(max(a.msg.t_ns for a in acks.values()) - t_cancel) / 1e6:.2f}"
            " ms"
        )

        # the next turn works at once, and nothing of the old epoch is ever delivered again
        result = speak_turn(link, events, session, speech.pcm16, turn_id=2)
        assert result.transcript and result.audio
        assert all(e.epoch > old_epoch for e in result.events)
        assert all(e.epoch > old_epoch for e in drain(events, session))
    finally:
        link.close_session(session)


def test_cancel_latency_under_10_concurrent_sessions(
    link: PipelineLink, events: EventQueues
) -> None:
    rounds, n_sessions = 6, 10
    sessions = [link.open_session() for _ in range(n_sessions)]
    latencies_ms: list[float] = []
    kv_after: list[float] = []
    per_stage: dict[str, list[float]] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()

    def caller(session: int) -> None:
        try:
            for i in range(rounds):
                link.create_response(session, f"r{session}-{i}", text="say something long")
                wait_for(events, session, Kind.TEXT_DELTA)
                cancel_id, t = link.cancel(session, f"r{session}-{i}")
                acks = wait_acks(events, session, cancel_id)
                with lock:
                    latencies_ms.append((max(a.msg.t_ns for a in acks.values()) - t) / 1e6)
                    for name, a in acks.items():
                        per_stage.setdefault(name, []).append((a.msg.t_ns - t) / 1e6)
                    kv_after.append(acks["reasoning"].msg.kv_usage)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=caller, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for s in sessions:
        link.close_session(s)
    assert not failures, failures[0]
    assert len(latencies_ms) == rounds * n_sessions
    p50, p99 = np.percentile(latencies_ms, [50, 99])
    print(
        f"\ncancel -> last ack over {len(latencies_ms)} cancels, {n_sessions} sessions: "
        f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {max(latencies_ms):.2f} ms"
    )
    for name, values in sorted(per_stage.items()):
        print(
            f"  {name:<10} p50 {np.percentile(values, 50):6.2f} ms  "
            f"p99 {np.percentile(values, 99):6.2f} ms"
        )
    # The target is p99 < 30 ms; the reasoning ack waits for the vLLM step that frees the KV
    # blocks, and a step of the CPU engine under this load takes 10-50 ms on 2 cores, so the
    # suite holds a bound that catches a stuck or serialised cancel path, and prints the figure
    # (docs/benchmarks.md has the measured runs).
    assert p99 < 150, f"cancel p99 {p99:.1f} ms: the cancel path is stalling"
    assert kv_after and min(kv_after) >= 0.0


def test_audio_after_cancel_keeps_the_new_speech(
    link: PipelineLink, events: EventQueues, make_speech
) -> None:
    """Barge-in order: cancel at speech onset, then the new turn's audio; it is transcribed."""
    speech = make_speech(SENTENCE)
    session = link.open_session()
    try:
        link.create_response(session, "resp_talking", text="keep talking")
        wait_for(events, session, Kind.AUDIO_OUT)
        link.cancel(session, "resp_talking")
        result = speak_turn(link, events, session, speech.pcm16, turn_id=7)
        assert result.transcript and result.reply_text
    finally:
        link.close_session(session)


def test_collect_reply_surfaces_stage_errors(link: PipelineLink, events: EventQueues) -> None:
    """A record the stages cannot decode becomes an ERROR event, and the session goes on."""
    from stages.driver import TurnFailed

    session = link.open_session()
    try:
        link.ends.outbox("reasoning", session).push(session, Kind.TRUNCATE, b"\xc1garbage")
        with pytest.raises(TurnFailed, match="bad_record"):
            collect_reply(events, session, TurnResult(), timeout=10)
        link.create_response(session, "resp_after", text="hello")
        assert collect_reply(events, session, TurnResult(), timeout=30).audio
    finally:
        link.close_session(session)


def _turn(link: PipelineLink, session: int, turn_id: int, *parts: np.ndarray | str) -> None:
    """Speak `parts` as one turn: audio is sent in 200 ms chunks, 'pause' and 'resume' are the
    gateway's TURN_PAUSED and TURN_RESUMED, and the turn ends after 200 ms of silence."""
    from stages.messages import CHUNK_SAMPLES

    link.speech_started(session, turn_id)
    for part in parts:
        if isinstance(part, str):
            (link.turn_paused if part == "pause" else link.turn_resumed)(session, turn_id)
        else:
            for start in range(0, len(part), CHUNK_SAMPLES):
                assert link.send_audio(session, part[start : start + CHUNK_SAMPLES])
    link.send_audio(session, np.zeros(3200, np.int16))  # the VAD's silence window
    link.speech_stopped(session, turn_id)


def _replies(result) -> list[str]:
    return [ev.msg.response_id for ev in result.events if ev.kind is Kind.RESPONSE_STARTED]


def _spoken_from_the_start(result) -> bool:
    """The phrases spoken are the reply's text from its start. Compared without whitespace: a
    phrase may end inside a long word (stages.phrases.CHARS_PER_WORD), and the tiny model's
    random tokens make such words."""
    spoken = "".join("".join(e.msg.text.split()) for e in result.events if e.kind is Kind.PHRASE)
    return bool(spoken) and "".join(result.reply_text.split()).startswith(spoken)


def test_reply_started_at_a_pause_is_the_turns_reply_when_it_ends(
    link: PipelineLink, events: EventQueues, make_speech
) -> None:
    """The encoder transcribes at the pause and reasoning starts then, held back; the turn ends
    with no more speech: that transcript is final and that reply is sent, once."""
    from stages.driver import TurnResult

    session = link.open_session()
    try:
        _turn(link, session, 1, make_speech(SENTENCE).pcm16, "pause")
        prepared = collect_reply(events, session, TurnResult())
    finally:
        link.close_session(session)
    assert prepared.transcript
    assert _replies(prepared) == [f"resp_{session}_1"]  # one reply, the one started early
    assert prepared.reply_text and prepared.audio
    finals = [e.msg for e in prepared.events if e.kind is Kind.TRANSCRIPT and e.msg.final]
    (final,) = [m for m in finals if not m.speculative]
    # the turn so far at the pause reaches the gateway once, for semantic_vad to weigh its
    # words (not judged: this encoder has no words model); only the final one commits it
    (early,) = [m for m in finals if m.speculative]
    assert early.finished == -1.0 and early.text == final.text
    assert _spoken_from_the_start(prepared)


def test_reply_started_at_a_pause_is_dropped_when_the_caller_goes_on(
    link: PipelineLink, events: EventQueues, make_speech
) -> None:
    """The caller speaks again after the pause: the early reply is dropped (never sent), and the
    turn's transcript covers everything said."""
    from stages.driver import TurnResult

    first, second = make_speech("tell me something nice"), make_speech("about the weather")
    gap = np.zeros(3200, np.int16)
    session = link.open_session()
    try:
        _turn(link, session, 1, first.pcm16, "pause", gap, "resume", second.pcm16)
        resumed = collect_reply(events, session, TurnResult())
    finally:
        link.close_session(session)
    # pocketsphinx adapts to each decoder's past audio, so the words differ from one decoder to
    # another: what counts is that the second half was heard
    direct = load_pocketsphinx().open_stream()
    direct.feed(first.pcm16)
    first_half = direct.finish()
    assert len(resumed.transcript.split()) > len(first_half.split()), resumed.transcript
    assert _replies(resumed) == [f"resp_{session}_1"]  # only the turn's final reply
    assert resumed.reply_text and resumed.audio
    # the early reply's audio, made while it was held, was dropped: what is heard is the
    # final reply's
    assert _spoken_from_the_start(resumed)
