"""The callers' turns joined with the stage records the gateway received (loadtest.tap): turn
latency split into hops by the records' CLOCK_MONOTONIC stamps (one host, one clock), the
model time on each, barge-in at the client, cancel latency per stage and inter-token
intervals."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from loadtest.bench import summary
from loadtest.tap import Seen

HOPS = (
    ("vad_decision", "end_of_speech", "speech_stopped"),
    ("encoder", "speech_stopped", "transcript"),
    ("first_token", "transcript", "first_token"),
    ("first_phrase", "first_token", "first_phrase"),
    ("first_audio_chunk", "first_phrase", "first_audio_chunk"),
    ("playout", "first_audio_chunk", "first_audio_heard"),
)


def stage_milestones(seen: list[Seen]) -> dict[str, Any]:
    """Per call: final transcripts, and per response its milestones (ring stamps, ns)."""
    from stages.messages import Kind

    calls: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"finals": [], "responses": {}, "by_turn": {}}
    )
    phrase_of: dict[tuple[str | None, int], str] = {}  # (call, session) -> response speaking
    for s in seen:
        c = calls[s.call_id or f"session-{s.session}"]
        if s.kind is Kind.TRANSCRIPT and s.msg.final and not s.msg.speculative:
            c["finals"].append((s.msg.speech_stopped_ns, s.t_ns, s.msg.turn_id, s.msg.decode_ns))
        elif s.kind is Kind.RESPONSE_STARTED and s.stage == "reasoning":
            r = c["responses"].setdefault(s.msg.response_id, {"deltas": []})
            r["started"], r["started_at_gateway"] = s.t_ns, s.recv_ns
            c["by_turn"][s.msg.turn_id] = s.msg.response_id
        elif s.kind is Kind.TEXT_DELTA and s.stage == "reasoning":
            r = c["responses"].setdefault(s.msg.response_id, {"deltas": []})
            r["deltas"].append(s.t_ns)
            if s.msg.index == 0:
                r["since_submit"] = s.msg.since_submit_ns
        elif s.kind is Kind.PHRASE:
            r = c["responses"].setdefault(s.msg.response_id, {"deltas": []})
            if "first_phrase" not in r:
                r["first_phrase"], r["phrase_ready"] = s.t_ns, s.msg.ready_ns
                r["first_phrase_at_gateway"] = s.recv_ns
            phrase_of[(s.call_id, s.session)] = s.msg.response_id
        elif s.kind is Kind.AUDIO_OUT:
            rid = phrase_of.get((s.call_id, s.session))
            r = c["responses"].get(rid) if rid else None
            if r is not None and "first_audio_chunk" not in r:
                r["first_audio_chunk"] = s.t_ns
                r["first_audio_at_gateway"] = s.recv_ns
    return calls


def voice_before_start(seen: list[Seen]) -> dict[str, int]:
    """How many replies' first phrase reached a gateway process's reader threads before the
    reply's RESPONSE_STARTED did: the two come on different rings, and the gateway keeps such
    a reply's voice until its start (gateway.session)."""
    replies = [
        r
        for c in stage_milestones(seen).values()
        for r in c["responses"].values()
        if "started_at_gateway" in r and "first_phrase_at_gateway" in r
    ]
    early = sum(r["first_phrase_at_gateway"] < r["started_at_gateway"] for r in replies)
    return {"replies_spoken": len(replies), "voice_first": early}


def turn_hops(reports: list[dict[str, Any]], seen: list[Seen]) -> list[dict[str, float]]:
    """Each caller turn's milestones (ns) joined with the stages': a dict of hop -> ms, plus
    "model": the model time on the turn's path, as the stages timed it (the recognizer after the
    end of speech, the engine's first token, the tokens the first phrase waited for, its first
    audio chunk), and "overhead_<hop>": each hop less its model time."""
    calls = stage_milestones(seen)
    turns = []
    for report in reports:
        c = calls.get(report["call_id"])
        for turn in report["turns"]:
            if turn.get("first_audio") is None:
                continue
            t = {
                "end_of_speech": int(turn["end_of_speech"] * 1e9),
                "first_audio_heard": int(turn["first_audio"] * 1e9),
            }
            final = None
            if c is not None:
                final = min(
                    (f for f in c["finals"] if f[0] >= t["end_of_speech"]),
                    default=None,
                    key=lambda f: f[0],
                )
            model_ns = None
            if final is not None:
                t["speech_stopped"], t["transcript"] = final[0], final[1]
                r = c["responses"].get(c["by_turn"].get(final[2], ""), {})
                if r.get("deltas"):
                    t["first_token"] = r["deltas"][0]
                for key in ("first_phrase", "first_audio_chunk"):
                    if key in r:
                        t[key] = r[key]
                if r.get("deltas") and r.get("phrase_ready") and "first_audio_chunk" in r:
                    # model time on the turn's critical path, per hop
                    model_ns = {
                        "encoder": final[3],  # recognizer work after the end of speech
                        "first_token": r.get("since_submit", 0),  # the engine's first token
                        "first_phrase": r["phrase_ready"] - r["deltas"][0],  # its words
                        "first_audio_chunk": r["first_audio_chunk"] - r["first_phrase"],
                    }
            if c is not None and "first_token" not in t:
                # no final transcript for the turn (under speech-in it may come after the call
                # ended): the reply whose voice reached the gateway last before the caller
                # heard one is the one that answered
                heard = [
                    r
                    for r in c["responses"].values()
                    if r.get("deltas")
                    and r.get("first_audio_at_gateway", t["first_audio_heard"] + 1)
                    <= t["first_audio_heard"]
                ]
                if heard:
                    answer = max(heard, key=lambda r: r["first_audio_at_gateway"])
                    t["first_token"] = answer["deltas"][0]
            hops = {"turn": (t["first_audio_heard"] - t["end_of_speech"]) / 1e6}
            if "first_token" in t:  # whatever came between (a transcript, or speech-in rows)
                hops["to_first_token"] = (t["first_token"] - t["end_of_speech"]) / 1e6
            for name, a, b in HOPS:
                if a in t and b in t:
                    hops[name] = (t[b] - t[a]) / 1e6
            if model_ns is not None and all(name in hops for name in model_ns):
                # model time on the path is at most its hop: a reply prepared at the caller's
                # pause (gateway.turns.prepare_reply_ms) made its first token before the turn ended
                model_ms = {n: min(max(ns / 1e6, 0.0), hops[n]) for n, ns in model_ns.items()}
                hops["model"] = sum(model_ms.values())
                # what is left of each hop once its model time is out: rings, queues, the
                # gateway (the VAD hop's share is what exceeds the silence window)
                for name, _, _ in HOPS:
                    hops[f"overhead_{name}"] = hops[name] - model_ms.get(name, 0.0)
            turns.append(hops)
    return turns


def cancel_latencies(seen: list[Seen]) -> dict[str, list[float]]:
    """CANCEL to each stage's ack and to the last one (ms), for cancels all three acked."""
    from stages.messages import Kind

    acks: dict[tuple[str | None, int], dict[str, Any]] = defaultdict(dict)
    for s in seen:
        if s.kind is Kind.CANCEL_ACK and s.cancel_sent_ns is not None:
            a = acks[(s.call_id, s.msg.cancel_id)]
            a["sent"] = s.cancel_sent_ns
            a[s.msg.stage] = s.msg.t_ns
    out: dict[str, list[float]] = defaultdict(list)
    for a in acks.values():
        stages = [k for k in a if k != "sent"]
        for stage in stages:
            out[stage].append((a[stage] - a["sent"]) / 1e6)
        if len(stages) == 3:
            out["last_ack"].append((max(a[k] for k in stages) - a["sent"]) / 1e6)
    return out


def inter_token_ms(seen: list[Seen], response_ids: set[str] | None = None) -> list[float]:
    """Intervals between consecutive text deltas of each reply (reasoning's ring stamps)."""
    from stages.messages import Kind

    stamps: dict[str, list[int]] = defaultdict(list)
    for s in seen:
        if s.kind is not Kind.TEXT_DELTA or s.stage != "reasoning":
            continue
        if response_ids is None or s.msg.response_id in response_ids:
            stamps[s.msg.response_id].append(s.t_ns)
    return [(b - a) / 1e6 for ts in stamps.values() for a, b in itertools.pairwise(ts)]


def load_figures(
    reports: list[dict[str, Any]],
    seen: list[Seen],
    silence_ms: int,
    qs: tuple[float, ...] = (50, 95),
    per_turn: bool = False,
) -> dict[str, Any]:
    """Turn latency and its hops, barge-in at the client (percentiles `qs`), cancel latency
    per stage and inter-token latency (p50/p99) of one load; with `per_turn`, every turn's
    hops too (`turns`: a tail's turns, each with all its hops)."""
    turns = turn_hops(reports, seen)
    total = [t["turn"] for t in turns]
    barge = [
        (t["agent_stopped"] - t["onset"]) * 1000
        for r in reports
        for t in r["turns"]
        if t.get("agent_stopped") is not None
    ]
    cancels = cancel_latencies(seen)
    return {
        "callers": len(reports),
        "turns_answered": len(total),
        "turns_asked": sum(len(r["turns"]) for r in reports),
        "errors": [r["error"] for r in reports if r["error"]],
        "turn_ms": summary(total, *qs),
        # the caller's end of speech to the reply's first token (reasoning's stamp)
        "first_token_ms": summary(
            [t["to_first_token"] for t in turns if "to_first_token" in t], *qs
        ),
        "turn_beyond_vad_window_ms": summary([x - silence_ms for x in total], *qs),
        # gateway + rings + scheduling: the turn less the VAD window and the model time
        "pipeline_overhead_ms": summary(
            [t["turn"] - silence_ms - t["model"] for t in turns if "model" in t], *qs
        ),
        "overhead_by_hop_ms": {
            name: summary(
                [
                    t[f"overhead_{name}"] - (silence_ms if name == "vad_decision" else 0)
                    for t in turns
                    if "model" in t
                ],
                *qs,
            )
            for name, _, _ in HOPS
        },
        "hops_ms": {
            name: summary([t[name] for t in turns if name in t], *qs) for name, _, _ in HOPS
        },
        "barge_in_at_client_ms": summary(barge, *qs),
        "voice_before_start": voice_before_start(seen),
        "cancel_ms": {k: summary(v, 50, 99) for k, v in sorted(cancels.items())},
        "inter_token_ms_during_calls": summary(inter_token_ms(seen), 50, 99),
    } | ({"turns": [{k: round(v, 2) for k, v in t.items()} for t in turns]} if per_turn else {})
