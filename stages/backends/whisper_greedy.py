"""Whisper's greedy decode of a batch of windows, without `generate()`.

What `WhisperForConditionalGeneration.generate` does for a window of up to 30 s with a known
language and no timestamps: encode once, force the prompt (start of transcript, language,
task, no timestamps), then pick the likeliest token step by step with the checkpoint's
suppressed tokens masked out, until every window has said end-of-text or the cap is reached.
The same tokens (tests/stages/test_asr_whisper.py checks), with a fraction of the host work
per step: generate's logits processors, stopping criteria and long-form bookkeeping launch
many small kernels and a host sync every step, which a GPU shared with vLLM makes each wait
for. Here the host looks at the tokens only every `STOP_CHECK_STEPS` steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: decoder steps between two looks (a host sync) at whether every window has ended
STOP_CHECK_STEPS = 4


class GreedyDecoder:
    """The prompt and masks of one Whisper checkpoint, ready to decode batches."""

    def __init__(self, model: Any, generation_config: Any, language: str | None, task: str) -> None:
        import torch

        config = generation_config
        prompt = [config.decoder_start_token_id]
        if getattr(config, "is_multilingual", False):
            if language is None:
                raise ValueError("greedy decoding needs the language of a multilingual model")
            prompt += [config.lang_to_id[f"<|{language}|>"], config.task_to_id[task]]
        prompt.append(config.no_timestamps_token_id)
        self.prompt = prompt
        self.max_new_tokens: int = config.max_new_tokens or config.max_length - len(prompt)
        eos = config.eos_token_id
        self.eos: int = eos[0] if isinstance(eos, list) else eos
        # what follows a window's end-of-text, as generate() pads it
        self.pad: int = self.eos if config.pad_token_id is None else config.pad_token_id
        device = model.device
        self._model = model
        self._suppress = torch.tensor(config.suppress_tokens or [], dtype=torch.long, device=device)
        self._suppress_first = torch.tensor(
            config.begin_suppress_tokens or [], dtype=torch.long, device=device
        )

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """The tokens each window says after the prompt, then `pad` from its end-of-text on, on
        the model's device. Call under ``torch.inference_mode()``."""
        import torch
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        model = self._model
        audio = model.model.encoder(features).last_hidden_state
        batch = audio.shape[0]
        ids = torch.tensor([self.prompt] * batch, device=audio.device)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        ended = torch.zeros(batch, dtype=torch.bool, device=audio.device)
        said: list[torch.Tensor] = []
        for step in range(self.max_new_tokens):
            hidden = model.model.decoder(
                input_ids=ids, encoder_hidden_states=audio, past_key_values=cache, use_cache=True
            ).last_hidden_state
            logits = model.proj_out(hidden[:, -1])
            logits[:, self._suppress] = -float("inf")
            if step == 0:
                logits[:, self._suppress_first] = -float("inf")
            token = logits.argmax(-1)
            ended |= token == self.eos
            said.append(token.masked_fill(ended, self.pad))  # end-of-text too, as generate()
            if (step + 1) % STOP_CHECK_STEPS == 0 and bool(ended.all()):
                break
            ids = token[:, None]
        return torch.stack(said, 1)
