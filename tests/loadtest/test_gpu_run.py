"""The GPU run's CPU side: its layouts against the placement checks, the variants its command
line sets, and the caller's question. No GPU and no model."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.config import ConfigError
from loadtest.conversation import FRAME, WatchedSpeaker, last_voiced_frame
from loadtest.gpu_layouts import (
    PLACEHOLDER_MODELS,
    ThreadShares,
    Variant,
    Vocoders,
    layout_config,
)
from loadtest.gpu_run import main, sessions_of_first_gateway
from loadtest.settings import parse_setting
from loadtest.voices import caller_speech
from stages.placement import PlacementError, plan

MODELS = PLACEHOLDER_MODELS


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


def test_speech_in_layouts_differ_from_each_other_only_in_their_model_and_prefill() -> None:
    layouts = {
        name: layout_config(name, MODELS, gpu_count=1, device="cuda")[0]
        for name in ("speech-in", "speech-in-at-end", "speech-in-ultravox")
    }
    assert {n: c.reasoning.model for n, c in layouts.items()} == {
        "speech-in": "m",
        "speech-in-at-end": "m",
        "speech-in-ultravox": "u",
    }
    assert {n: c.reasoning.speech_in.prefill_while_speaking for n, c in layouts.items()} == {
        "speech-in": True,
        "speech-in-at-end": False,
        "speech-in-ultravox": True,
    }
    one, _ = layout_config("one", MODELS, gpu_count=1, device="cuda")
    speech_in = layouts["speech-in"]
    assert one.reasoning.speech_in is None and speech_in.encoder == one.encoder
    assert speech_in.reasoning.engine_args == one.reasoning.engine_args
    assert speech_in.gateway == one.gateway and speech_in.vocoder == one.vocoder


def test_cpu_try_out_layout_needs_no_gpu() -> None:
    config, _ = layout_config("one", MODELS, gpu_count=0, device="cpu")
    assert all(p.gpus is None for p in plan(config, gpu_count=0, environ={}).values())


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
