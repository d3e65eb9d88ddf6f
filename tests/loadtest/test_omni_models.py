"""loadtest.omni_models: the Qwen2.5-Omni folder vLLM-Omni serves with random weights has the
7B's shapes and a tokenizer whose special tokens sit at the ids the model expects."""

from __future__ import annotations

import pytest

from loadtest.omni_models import (
    CHAT_TEMPLATE,
    EXPECTED_IDS,
    omni_config,
    omni_tokenizer,
    qwen_ranks,
)


def test_the_7b_configuration_has_qwen25_omni_7b_shapes() -> None:
    config = omni_config("7b")
    thinker, talker = config.thinker_config, config.talker_config
    assert (thinker.text_config.hidden_size, thinker.text_config.num_hidden_layers) == (3584, 28)
    assert thinker.text_config.vocab_size == 152064
    assert (thinker.audio_config.d_model, thinker.audio_config.encoder_layers) == (1280, 32)
    assert (thinker.vision_config.hidden_size, thinker.vision_config.out_hidden_size) == (
        1280,
        3584,
    )
    assert (talker.hidden_size, talker.num_hidden_layers, talker.vocab_size) == (896, 24, 8448)
    assert thinker.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.enable_audio_output


def test_the_saved_thinker_keeps_the_vision_markers_vllm_omni_reads(tmp_path) -> None:
    from transformers import AutoConfig

    omni_config("7b").save_pretrained(tmp_path)
    thinker = AutoConfig.from_pretrained(tmp_path).thinker_config
    assert (
        thinker.vision_start_token_id,
        thinker.vision_end_token_id,
        thinker.vision_token_id,
    ) == (151652, 151653, 151654)


def test_the_tokenizer_is_qwen2s_with_omnis_special_tokens() -> None:
    tokenizer = omni_tokenizer(qwen_ranks())
    for token, expected in EXPECTED_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == expected
    assert tokenizer("Hello world")["input_ids"] == [9707, 1879]  # Qwen2's own ids
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    prompt = tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_an_unknown_preset_is_refused() -> None:
    with pytest.raises(ValueError, match="preset 'huge'"):
        omni_config("huge")
