"""Prometheus metrics of one gateway process.

With several gateway processes (prometheus_client's multiprocess mode) counters and histograms
add up over them; gauges say how to: sessions add up, each ring belongs to one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
)


FRAME_INTERVAL_BUCKETS = (0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.0)
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.sessions = Gauge(
            "omni_sessions", "Calls in progress", registry=r, multiprocess_mode="livesum"
        )
        self.sessions_refused = Counter(
            "omni_sessions_refused", "Calls refused at admission", registry=r
        )
        self.turn_latency = Histogram(
            "omni_turn_latency_seconds",
            "Caller's end of speech (VAD) to the first agent audio queued for playout",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_audio = Histogram(
            "omni_time_to_first_audio_seconds",
            "Response start to its first audio chunk",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cancel_latency = Histogram(
            "omni_cancel_latency_seconds",
            "CANCEL to each stage's acknowledgement",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.frame_interval = Histogram(
            "omni_audio_frame_interval_seconds",
            "Time between a call's consecutive 20 ms frames: caller audio received (in), agent "
            "audio sent (out); an interval over 0.08 s is a gap of over 60 ms",
            ["direction"],
            buckets=FRAME_INTERVAL_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "omni_event_loop_lag_seconds",
            "How late the gateway's event loop woke a 20 ms timer (every call's audio waits "
            "as long); with no call, a 1 s timer",
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "omni_gc_pause_seconds",
            "Garbage collections in the gateway process, by generation (2: full)",
            ["generation"],
            buckets=STALL_BUCKETS,
            registry=r,
        )
        self.turn_end_silence = Histogram(
            "omni_turn_end_silence_seconds",
            "The caller's silence after their last speech when the VAD ended their turn, by "
            "turn detection (server_vad: its silence window; semantic_vad: shorter when the "
            "end-of-turn model is sure)",
            ["type"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.end_of_turn = Histogram(
            "omni_end_of_turn_seconds",
            "semantic_vad: one end-of-turn prediction, queued and run off the event loop",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.end_of_turn_decisions = Counter(
            "omni_end_of_turn_decisions",
            "semantic_vad at a pause: the turn ended at once (ended), left to the silence "
            "window (window), held up to the eagerness's maximum wait (held), the caller's "
            "voice came back first (spoke_again), or the silence window ended the turn before "
            "the decision came (after_the_turn)",
            ["decision"],
            registry=r,
        )
        self.end_of_turn_decided_after = Histogram(
            "omni_end_of_turn_decided_after_seconds",
            "semantic_vad: the caller's silence when the decision at a pause was made, by "
            "decision (the sound model's and the words' time included)",
            ["decision"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.end_of_turn_probability = Histogram(
            "omni_end_of_turn_probability",
            "semantic_vad: the probability each model gave at a pause that the turn is over "
            "(sound: the end-of-turn model; words: the encoder's judgement), by decision",
            ["model", "decision"],
            buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.97, 1.0),
            registry=r,
        )
        self.end_of_turn_words = Histogram(
            "omni_end_of_turn_words_wait_seconds",
            "semantic_vad: from asking the end-of-turn model to having the encoder's judgement "
            "of the words at the pause, by whether it came in time (judged) or not (late)",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.barge_ins = Counter("omni_barge_ins", "Agent replies cut by the caller", registry=r)
        self.false_interruptions = Counter(
            "omni_false_interruptions",
            "Provisional turns over the agent that did not count (the agent resumed)",
            registry=r,
        )
        self.voice_ahead = Counter(
            "omni_voice_ahead_of_reply",
            "Vocoder records (phrases, audio) that reached the gateway before their reply's "
            "start and were kept for it",
            registry=r,
        )
        self.agent_holds = Counter(
            "omni_agent_holds",
            "Times the agent's audio was held at a voice over it, until the VAD judged it "
            "(gateway.turns.interruptions.hold_on_voice): its own echo, if it hears that",
            registry=r,
        )
        self.echo_cancel_seconds = Counter(
            "omni_echo_cancel_seconds",
            "Time spent in the echo canceller (gateway.echo, on its own thread), all calls",
            registry=r,
        )
        self.vad_events = Counter(
            "omni_vad_events", "Speech starts and stops", ["event"], registry=r
        )
        self.ring_bytes_used = Gauge(
            "omni_ring_bytes_used",
            "Bytes queued in a ring",
            ["ring"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ring_full = Gauge(
            "omni_ring_full_total",
            "Pushes refused by a full ring",
            ["ring"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ring_skipped = Gauge(
            "omni_ring_skipped_total",
            "Records dropped as stale (cancelled epochs)",
            ["ring"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_usage = Gauge(
            "omni_vllm_kv_usage",
            "vLLM KV-cache usage at the last cancel ack",
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.stage_errors = Counter(
            "omni_stage_errors", "ERROR records from stages", ["stage"], registry=r
        )
