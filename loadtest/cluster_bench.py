"""A stage across a network hop against the same stage on a ring: turns and cancels, one run.

Run: python -m loadtest.cluster_bench [--config configs/tiny.yaml] [--turns 4] [--sessions 10]
     [--cancels 3] [--rounds 2] [--json FILE]

Two layouts of the same pipeline take turns, round by round, each started afresh so that a
noisy spell of the machine falls on both: `ring`, every stage on the gateway's host, and
`hop`, the encoder and the vocoder placed by Ray on another node (`stages.cluster`: a Ray
cluster of raylets on loopback addresses, `stages.loopback_cluster`, the other node on
127.0.0.2, every record between the hosts crossing TCP through stages.bridge). The cluster runs
for the whole benchmark, so that its processes idle beside both layouts. In each round:
- turns: `--turns` spoken turns one after another (`stages.driver.speak_turn`), each timed
  hop by hop as the gateway's host sees the records arrive: speech stopped -> transcript ->
  reply started -> first token -> first phrase -> first audio. The hop layout crosses the
  network four times on that path (the end of speech out, the transcript to reasoning, the
  text to the vocoder, the audio back);
- cancels: `--sessions` sessions at once, each cancelling `--cancels` replies mid-stream:
  CANCEL to each stage's acknowledgement received at the gateway's end (the ack's arrival in
  the gateway's ring: across the hop the ack's own stamp is another host's clock), and to
  the last of the three.
Prints a table, then JSON; one machine, its loopback for the network (docs/scaling.md says
what that does and does not show).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.ring_bench import machine

ROOT = Path(__file__).parents[1]
LAYOUTS = ("ring", "hop")
FAR = ("encoder", "vocoder")  # the stages the hop layout runs on the other node
FAR_NODE = "127.0.0.2"
FAR_RESOURCE = "far"  # what only that node advertises
SENTENCE = "what is the weather like today in paris"
STAGES = ("encoder", "reasoning", "vocoder")
TURN_HOPS = (
    "speech_stopped->transcript",
    "transcript->response_started",
    "response_started->first_token",
    "first_token->first_phrase",
    "first_phrase->first_audio",
    "speech_stopped->first_audio",
)


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def pipeline(config: Any, layout: str, cluster: str) -> Iterator[Any]:
    """The layout's pipeline, its gateway end's link and events; `cluster`: the address of the
    Ray cluster the hop layout places its far stages on."""
    from stages.cluster import ClusterSupervisor
    from stages.config import ClusterConfig
    from stages.link import EventQueues, PipelineLink
    from stages.supervisor import Supervisor

    with contextlib.ExitStack() as stack:
        if layout == "ring":
            supervisor = Supervisor(config)
        else:
            far = {"stages": list(FAR), "resources": {FAR_RESOURCE: 1}}
            placement = ClusterConfig(address=cluster, groups={"b": far})
            supervisor = ClusterSupervisor(config, placement)
        stack.enter_context(supervisor)
        supervisor.start(progress=log)
        events = EventQueues()
        link = PipelineLink(supervisor.names, events)
        stack.callback(link.close)
        yield link, events


def _speech() -> np.ndarray:
    """The question, spoken by espeak-ng at 16 kHz."""
    import subprocess
    import tempfile
    import wave

    with tempfile.TemporaryDirectory() as folder:
        wav = Path(folder) / "q.wav"
        subprocess.run(
            ["espeak-ng", "-w", str(wav), SENTENCE], check=True, capture_output=True, timeout=60
        )
        subprocess.run(
            [
                "sox",
                str(wav),
                "-r",
                "16000",
                "-c",
                "1",
                "-b",
                "16",
                str(wav.with_suffix(".16k.wav")),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        with wave.open(str(wav.with_suffix(".16k.wav"))) as reader:
            pcm = np.frombuffer(reader.readframes(reader.getnframes()), np.int16)
    silence = np.zeros(8000, np.int16)
    return np.concatenate([silence, pcm, silence])


def turns(link: Any, events: Any, speech: np.ndarray, n: int) -> list[dict[str, float]]:
    from stages.driver import speak_turn

    out = []
    session = link.open_session()
    try:
        for turn in range(1, n + 1):
            result = speak_turn(link, events, session, speech, turn_id=turn)
            if not result.audio:
                raise RuntimeError(f"turn {turn} brought no audio")
            out.append(result.hops_ms())
    finally:
        link.close_session(session)
    return out


def cancels(link: Any, events: Any, sessions: int, each: int) -> list[dict[str, float]]:
    """Each cancel's time to every stage's ack received at the gateway's end, in ms."""
    from stages.messages import Kind

    measured: list[dict[str, float]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def wait(session: int, kind: Kind, deadline: float) -> Any:
        while True:
            ev = events.next(session, max(0.01, deadline - time.monotonic()))
            if ev.kind is kind:
                return ev
            if ev.kind is Kind.ERROR:
                raise RuntimeError(f"session {session}: {ev.msg}")

    def caller(session: int) -> None:
        try:
            for i in range(each):
                deadline = time.monotonic() + 60
                link.create_response(session, f"r{session}-{i}", text="say something long")
                wait(session, Kind.TEXT_DELTA, deadline)
                cancel_id, t_ns = link.cancel(session, f"r{session}-{i}")
                acks: dict[str, float] = {}
                while len(acks) < 3:
                    ev = wait(session, Kind.CANCEL_ACK, deadline)
                    if ev.msg.cancel_id == cancel_id:
                        acks[ev.msg.stage] = (ev.t_ns - t_ns) / 1e6
                acks["last"] = max(acks.values())
                with lock:
                    measured.append(acks)
        except BaseException as exc:
            failures.append(exc)

    opened = [link.open_session() for _ in range(sessions)]
    threads = [threading.Thread(target=caller, args=(s,)) for s in opened]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    for session in opened:
        link.close_session(session)
    if failures:
        raise failures[0]
    return measured


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"n": len(values), "p50": round(float(p50), 2), "p95": round(float(p95), 2),
            "p99": round(float(p99), 2), "max": round(float(max(values)), 2)}  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """Markdown: a row per turn hop and per stage's cancel ack, p50 / p99 for each layout."""
    layouts = list(results)
    lines = [
        "| ms, p50 / p99 | " + " | ".join(layouts) + " |",
        "|---|" + "---:|" * len(layouts),
    ]
    rows = [(f"turn: {h}", "turn_hops_ms", h) for h in TURN_HOPS]
    rows += [(f"cancel to ack: {s}", "cancel_ms", s) for s in (*STAGES, "last")]
    for label, group, key in rows:
        cells = [results[n][group][key] for n in layouts]
        lines.append(
            f"| {label} | "
            + " | ".join(f"{c.get('p50', '-')} / {c.get('p99', '-')}" for c in cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--turns", type=int, default=4, help="spoken turns a round")
    parser.add_argument("--sessions", type=int, default=10, help="cancelling at once")
    parser.add_argument("--cancels", type=int, default=3, help="replies each session cancels")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--json", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    if not layouts or set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts {args.layouts!r}: of {', '.join(LAYOUTS)}")
    if min(args.turns, args.sessions, args.cancels, args.rounds) < 1:
        parser.error("--turns, --sessions, --cancels and --rounds: at least 1")

    from gateway.config import load_config

    config = load_config(
        args.config,
        {
            "reasoning.sampling": {"max_tokens": 160, "ignore_eos": True},
            "vocoder.max_lead_ms": 600_000,  # no real-time listener: synthesize unpaced
        },
    )
    from stages.loopback_cluster import LoopbackCluster

    speech = _speech()
    raw: dict[str, dict[str, list]] = {name: {"turns": [], "cancels": []} for name in layouts}
    with LoopbackCluster() as cluster:
        cluster.add_node(FAR_NODE, {FAR_RESOURCE: 1})
        log(f"Ray cluster at {cluster.address}: nodes {', '.join(cluster.alive_nodes())}")
        for k in range(1, args.rounds + 1):
            for name in layouts:
                log(f"round {k}/{args.rounds}: {name}")
                with pipeline(config, name, cluster.address) as (link, events):
                    turns(link, events, speech, 1)  # a first turn warms the models: not counted
                    raw[name]["turns"] += turns(link, events, speech, args.turns)
                    raw[name]["cancels"] += cancels(link, events, args.sessions, args.cancels)
    results: dict[str, Any] = {}
    for name, got in raw.items():
        results[name] = {
            "turn_hops_ms": {h: summary([t[h] for t in got["turns"] if h in t]) for h in TURN_HOPS},
            "cancel_ms": {
                stage: summary([c[stage] for c in got["cancels"]]) for stage in (*STAGES, "last")
            },
        }
    report = {
        "benchmark": "cluster_bench",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "config": str(
            args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
        ),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "far_stages": list(FAR),
        "far_node": FAR_NODE,
        "results": results,
    }
    print(table(results))
    m = report["machine"]
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, Python {m['python']}")
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
