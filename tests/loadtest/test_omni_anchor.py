"""loadtest.omni_anchor's pieces that need no GPU: the streamed chunks vLLM-Omni sends are
read as the caller hears them, and the deploy configuration puts every stage on one GPU."""

from __future__ import annotations

import base64

import numpy as np
import yaml

from loadtest.omni_anchor import (
    RequestTiming,
    deploy_config,
    figures,
    read_chunk,
    request_body,
    table,
    wav_bytes,
)


def chunk(modality: str, content: str | None) -> dict:
    return {"modality": modality, "choices": [{"index": 0, "delta": {"content": content}}]}


def test_audio_chunks_are_timed_and_measured_as_whole_wav_files() -> None:
    reply = RequestTiming()
    second = base64.b64encode(wav_bytes(np.zeros(24000, np.int16), 24000)).decode()
    read_chunk(reply, {"choices": []}, 0.05)  # the usage chunk at the end has none
    read_chunk(reply, chunk("text", "Hel"), 0.1)
    read_chunk(reply, chunk("text", "lo"), 0.2)
    read_chunk(reply, chunk("audio", second), 1.5)
    read_chunk(reply, chunk("audio", second), 2.5)
    assert (reply.first_text_s, reply.first_audio_s, reply.last_audio_s) == (0.1, 1.5, 2.5)
    assert reply.audio_s == 2.0 and reply.audio_chunks == 2 and reply.rates == {24000}
    out = figures([reply, RequestTiming(error="HTTP 500: boom")], 1234)
    assert out["completed"] == "1/2" and out["errors"] == ["HTTP 500: boom"]
    assert out["first_audio_ms"]["p50"] == 1500.0 and out["audio_rtf"]["p50"] == 1.25


def test_a_failure_inside_the_stream_is_the_replys_error_in_the_servers_words() -> None:
    reply = RequestTiming()
    read_chunk(reply, chunk("text", "Hel"), 0.1)
    read_chunk(reply, {"error": {"message": "talker: index out of range", "code": 500}}, 0.3)
    assert reply.error == "server: talker: index out of range"
    assert figures([reply], None)["errors"] == [reply.error]


def test_every_stage_is_on_gpu_0_with_dummy_weights_and_async_chunk_off() -> None:
    config = yaml.safe_load(deploy_config(8))
    assert config["async_chunk"] is False
    assert [s["stage_id"] for s in config["stages"]] == [0, 1, 2]
    assert {s["devices"] for s in config["stages"]} == {"0"}
    assert {s["load_format"] for s in config["stages"]} == {"dummy"}
    # token2wav one request at a time: it decodes a batch's codes as one sequence
    assert [s["max_num_seqs"] for s in config["stages"]] == [8, 8, 1]
    assert sum(s["gpu_memory_utilization"] for s in config["stages"]) <= 0.9


def test_a_request_caps_every_stage_and_carries_the_question() -> None:
    wav = wav_bytes(np.ones(160, np.int16), 16000)
    body = request_body(wav, 64, 250)
    (content,) = body["messages"][0]["content"]
    assert base64.b64decode(content["input_audio"]["data"]) == wav
    thinker, talker, _ = body["sampling_params_list"]
    assert thinker["max_tokens"] == 64 and thinker["ignore_eos"]
    assert talker["min_tokens"] == talker["max_tokens"] == 250
    # vLLM keeps the talker's prompt ids (which its forward rewrites) only under a penalty
    assert talker["repetition_penalty"] != 1.0
    assert body["stream"] and body["modalities"] == ["text", "audio"]


def test_ours_stands_beside_vllm_omni_over_each_transport_at_each_load() -> None:
    def load(p50: float, answered: int) -> dict:
        return {
            "turn_ms": {"p50": p50, "p95": p50 + 50},
            "turn_beyond_vad_window_ms": {"p50": p50 - 500, "p95": p50 - 450},
            "turns_answered": answered,
            "turns_asked": 8,
            "cancel_ms": {"last_ack": {"p99": 4.5}},
        }

    omni = figures(
        [RequestTiming(first_text_s=0.1, first_audio_s=0.6, last_audio_s=1.0, audio_s=5.0)], 9
    )
    results = {
        "machine": {"gpus": ["GPU 0: H200"]},
        "vllm_omni": {"1": omni, "8": omni},  # read back from results.json: string keys
        "ours": {
            "layouts": {
                "one webrtc": {
                    "transport": "webrtc",
                    "gpu_memory_mib_by_stage": {"reasoning": 100, "vocoder": 20},
                    "loads": {"1": load(560, 8), "8": load(600, 7)},
                },
                "one websocket": {"transport": "websocket", "loads": {"1": load(540, 8)}},
                "one tp2": {"error": "RuntimeError: no second GPU"},
            }
        },
    }
    rows = [
        line for line in table(results).splitlines() if line.startswith("| ") and "|--" not in line
    ]
    assert [r.split(" | ")[:2] for r in rows[1:]] == [
        ["| ours, one tp2 webrtc (end of speech to first audio)", "-"],
        ["| vLLM-Omni (request to first audio)", "1"],
        ["| ours, one webrtc (end of speech to first audio)", "1"],
        ["| ours, one websocket (end of speech to first audio)", "1"],
        ["| vLLM-Omni (request to first audio)", "8"],
        ["| ours, one webrtc (end of speech to first audio)", "8"],
    ]
    assert rows[4] == (
        "| ours, one websocket (end of speech to first audio) | 1 | 540 / 590 | 40 / 90 | - | - "
        "| 8/8 | 4.5 | - |"
    )
    assert rows[6].endswith("| 7/8 | 4.5 | 120 |")
    assert "failed: RuntimeError: no second GPU" in rows[1]
