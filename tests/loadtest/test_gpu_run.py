"""The GPU run's CPU side: its layouts against the placement checks, and how it joins the
callers' clock readings with the ring records' stamps into hops, cancels and inter-token
intervals. No GPU and no model: records are made up with known times."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from gateway.config import ConfigError
from loadtest.conversation import FRAME, WatchedSpeaker, last_voiced_frame
from loadtest.gpu_run import (
    HOPS,
    Seen,
    ThreadShares,
    Traces,
    Variant,
    Vocoders,
    caller_speech,
    cancel_latencies,
    inter_token_ms,
    layout_config,
    load_figures,
    main,
    parse_setting,
    sessions_of_first_gateway,
    turn_hops,
    voice_before_start,
)
from stages.messages import CancelAck, Kind, Phrase, ResponseStarted, TextDelta, Transcript
from stages.placement import PlacementError, plan

MODELS = SimpleNamespace(whisper="w", chat="c", speecht5="t", hifigan="h", talker="o", snac="s")
MS = 1_000_000


def test_one_gpu_layout_puts_every_stage_on_gpu_0() -> None:
    config, notes = layout_config("one", MODELS, gpu_count=1, device="cuda")
    placements = plan(config, gpu_count=1, environ={})
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in placements.values()} == {"0"}
    assert not notes


def test_tp2_layout_on_two_gpus_shares_the_second_with_encoder_and_vocoder() -> None:
    config, notes = layout_config("tp2", MODELS, gpu_count=2, device="cuda")
    placements = plan(config, gpu_count=2, environ={})
    assert placements["reasoning"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert placements["encoder"].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert placements["vocoder"].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert config.reasoning.engine_args["tensor_parallel_size"] == 2
    assert "share GPU 1" in notes[0]


def test_tp2_layout_as_written_needs_three_gpus() -> None:
    config, _ = layout_config("tp2", MODELS, gpu_count=3, device="cuda")
    assert plan(config, gpu_count=3, environ={})["vocoder"].env["CUDA_VISIBLE_DEVICES"] == "2"
    with pytest.raises(PlacementError, match="encoder is placed on GPU 2"):
        plan(config, gpu_count=2, environ={})


def test_talker_layout_is_one_gpu_with_the_talker_voice() -> None:
    config, _ = layout_config("talker", MODELS, gpu_count=1, device="cuda")
    placements = plan(config, gpu_count=1, environ={})
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in placements.values()} == {"0"}
    assert (config.vocoder.backend, config.vocoder.model, config.vocoder.vocoder) == (
        "talker",
        "o",
        "s",
    )
    # everything else as gpu-one.yaml has it, so the two run like with like
    one, _ = layout_config("one", MODELS, gpu_count=1, device="cuda")
    assert config.reasoning == one.reasoning and config.encoder == one.encoder
    assert config.gateway == one.gateway
    cpu, _ = layout_config("talker", MODELS, gpu_count=0, device="cpu")
    assert cpu.vocoder.device == "cpu" and cpu.vocoder.options["max_frames_per_char"] == 0.8


def test_cpu_try_out_layout_needs_no_gpu() -> None:
    config, _ = layout_config("one", MODELS, gpu_count=0, device="cpu")
    assert all(p.gpus is None for p in plan(config, gpu_count=0, environ={}).values())


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


def test_end_of_speech_is_the_frame_of_the_last_voiced_sample() -> None:
    clip = np.zeros(FRAME * 10, np.int16)
    clip[FRAME * 6 + 5] = 4000
    assert last_voiced_frame(clip) == 6


def test_the_agent_counts_as_stopped_once_200_ms_are_silent() -> None:
    speaker = WatchedSpeaker()
    levels = [500.0] * 5 + [10.0] * 3 + [500.0] + [10.0] * 12
    speaker.arrivals = [0.02 * i for i in range(len(levels))]
    speaker.levels = levels
    assert speaker.stopped_after(0.0) == pytest.approx(0.02 * 9)
    assert speaker.stopped_after(0.3) is None


def test_vocoder_variants_can_be_set_for_a_comparison(capsys) -> None:
    variant = Variant(vocoders=Vocoders.parse("4x1"))
    config, notes = layout_config("one", MODELS, gpu_count=1, device="cuda", variant=variant)
    assert (config.vocoder.replicas, config.vocoder.batch) == (4, 1)
    assert "vocoder.replicas: 4 (from the command line)" in notes
    assert "vocoder.batch: 1 (from the command line)" in notes
    config, _ = layout_config("one", MODELS, gpu_count=1, device="cuda")
    assert (config.vocoder.replicas, config.vocoder.batch) == (2, 8)  # configs/gpu-one.yaml
    for bad in ("4", "4x", "0x8", "1x65"):
        with pytest.raises(SystemExit):
            main(["--vocoders", bad])
        assert "vocoder variant" in capsys.readouterr().err


def test_gpu_sharing_variants_can_be_set_for_a_comparison(capsys) -> None:
    config, notes = layout_config("one", MODELS, 1, "cuda", Variant(sharing="time-slice"))
    assert config.gpu_sharing == "time-slice"
    assert "gpu_sharing: time-slice (from the command line)" in notes
    config, _ = layout_config("one", MODELS, gpu_count=1, device="cuda")
    assert config.gpu_sharing == "mps"  # configs/gpu-one.yaml
    with pytest.raises(SystemExit):
        main(["--gpu-sharing", "mps,shared"])
    assert "gpu sharing 'shared'" in capsys.readouterr().err


def test_prepare_reply_variants_can_be_set_for_a_comparison() -> None:
    config, notes = layout_config("one", MODELS, 1, "cuda", Variant(prepare_ms=200))
    assert config.gateway.turns.prepare_reply_ms == 200
    assert "gateway.turns.prepare_reply_ms: 200 (from the command line)" in notes


def test_vocoder_dtype_variants_keep_the_files_other_vocoder_options(capsys) -> None:
    for device in ("cuda", "cpu"):
        config, _ = layout_config("one", MODELS, 1, device, Variant(vocoder_dtype="bfloat16"))
        assert config.vocoder.options["dtype"] == "bfloat16"
        assert "maxlenratio" in config.vocoder.options  # the file's, or the CPU try-out's
    with pytest.raises(SystemExit):
        main(["--vocoder-dtype", "float32,int8"])
    assert "vocoder dtype 'int8'" in capsys.readouterr().err


def test_transport_variants_are_named_and_change_nothing_in_the_config(capsys) -> None:
    websocket = Variant(transport="websocket")
    assert websocket.key("one") == "one websocket"
    assert Variant(gateway_processes=1, transport="webrtc").key("one") == "one gw 1 webrtc"
    assert Variant().key("one") == "one"  # the default, WebRTC, as every earlier run's name
    config, notes = layout_config("one", MODELS, 1, "cuda", websocket)
    assert config == layout_config("one", MODELS, 1, "cuda")[0] and not notes
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--transports", "webrtc,sip"])
    assert "transport 'sip'" in capsys.readouterr().err


def test_mps_thread_share_variants(capsys) -> None:
    shares = ThreadShares.parse("reasoning=60:vocoder=40")
    config, _ = layout_config("one", MODELS, 1, "cuda", Variant(thread_shares=shares))
    assert config.experiments.mps_thread_percent == {"reasoning": 60, "vocoder": 40}
    uncapped = Variant(thread_shares=ThreadShares.parse("none"))
    assert layout_config("one", MODELS, 1, "cuda", uncapped)[0].experiments.mps_thread_percent == {}
    assert Variant(sharing="mps", thread_shares=shares).key("one") == (
        "one mps sm reasoning 60 vocoder 40"
    )
    # shares need MPS: the config says so instead of silently ignoring them
    with pytest.raises(ConfigError, match="mps_thread_percent"):
        layout_config("one", MODELS, 1, "cuda", Variant(sharing="time-slice", thread_shares=shares))
    for bad in ("reasoning", "reasoning=x", "decoder=50", "reasoning=0", "reasoning=60,vocoder"):
        with pytest.raises(SystemExit):
            main(["--mps-threads", bad])
        assert "MPS thread shares" in capsys.readouterr().err


def test_gateway_process_variants_trace_what_they_receive(tmp_path) -> None:
    variant = Variant(gateway_processes=4)
    assert variant.key("one") == "one gw 4"
    config, notes = layout_config("one", MODELS, 1, "cuda", variant, trace_dir=str(tmp_path))
    assert config.gateway.processes == 4 and config.gateway.trace_dir == str(tmp_path)
    assert "gateway.processes: 4 (from the command line)" in notes
    assert layout_config("one", MODELS, 1, "cuda")[0].gateway.trace_dir is None


def test_traces_of_every_gateway_process_are_read_as_one_tap(tmp_path) -> None:
    from gateway.trace import StageTrace
    from stages.envelope import Envelope

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


def test_any_config_key_can_be_a_variant_and_a_bad_one_fails_before_anything_runs(
    capsys,
) -> None:
    assert parse_setting("reasoning.sampling.max_tokens=400,60") == [
        ("reasoning.sampling.max_tokens", 400),
        ("reasoning.sampling.max_tokens", 60),
    ]
    short = Variant(settings=(("reasoning.sampling.max_tokens", 60),))
    config, notes = layout_config("one", MODELS, 1, "cuda", short)
    assert config.reasoning.sampling["max_tokens"] == 60
    assert short.key("one") == "one reasoning.sampling.max_tokens=60"
    assert "reasoning.sampling.max_tokens: 60 (from the command line)" in notes
    both = "encoder.options.stream_priority+vocoder.options.stream_priority"
    _, high = parse_setting(f"{both}=normal,high")[1]
    config, _ = layout_config("one", MODELS, 1, "cuda", Variant(settings=((both, high),)))
    assert config.encoder.options["stream_priority"] == "high"
    assert config.vocoder.options["stream_priority"] == "high"
    assert config.vocoder.options["dtype"] == "bfloat16"  # the file's other options stay
    pair = "gateway.turns.prepare_reply_ms+vocoder.first_phrase_words"
    early = Variant(settings=(parse_setting(f"{pair}=200+3,120+2")[1],))
    config, _ = layout_config("one", MODELS, 1, "cuda", early)
    assert (config.gateway.turns.prepare_reply_ms, config.vocoder.first_phrase_words) == (120, 2)
    assert early.key("one") == f"one {pair}=120+2"
    for bad in ("max_tokens", "=60", "reasoning..max_tokens=1", "a.b+=1", "a.b+c.d=1+2+3"):
        with pytest.raises(SystemExit):
            main(["--device", "cpu", "--set", bad])
        assert "--set" in capsys.readouterr().err
    # checked against the config before any model is built
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--set", "reasoning.max_tokenz=60"])
    assert "max_tokenz" in capsys.readouterr().err


def test_a_paused_caller_stops_mid_question_for_as_long_as_asked() -> None:
    def longest_silence_ms(pcm: np.ndarray) -> float:
        frames = [np.abs(pcm[i : i + FRAME]).max() <= 500 for i in range(0, len(pcm), FRAME)]
        longest = run = 0
        for quiet in frames[: last_voiced_frame(pcm)]:
            run = run + 1 if quiet else 0
            longest = max(longest, run)
        return longest * FRAME / 48

    plain, paused = caller_speech(), caller_speech(300)
    assert longest_silence_ms(plain) < 100  # espeak's gaps between words
    assert 280 <= longest_silence_ms(paused) <= 400  # in whole 20 ms frames
    assert abs(len(paused) - len(plain) - 300 * 48) < 0.1 * len(plain)  # the same words
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--caller-pause-ms", "-1"])


def test_more_inter_token_streams_than_one_gateway_process_has_sessions_fail_at_once(
    capsys,
) -> None:
    config, _ = layout_config("one", MODELS, 1, "cuda", Variant())
    own = len(sessions_of_first_gateway(config))
    assert own >= 32  # the default run's 32 replies at once fit
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--itl-streams", str(own + 1)])
    assert f"has {own}" in capsys.readouterr().err
