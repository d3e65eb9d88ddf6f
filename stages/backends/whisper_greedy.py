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

from collections.abc import Callable
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
        prompt = torch.tensor([self.prompt] * audio.shape[0], device=audio.device)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())

        def logits_after(token: torch.Tensor | None) -> torch.Tensor:
            ids = prompt if token is None else token[:, None]
            hidden = model.model.decoder(
                input_ids=ids, encoder_hidden_states=audio, past_key_values=cache, use_cache=True
            ).last_hidden_state
            return model.proj_out(hidden[:, -1])

        return self._pick_tokens(audio.shape[0], logits_after)

    def _pick_tokens(
        self, batch: int, logits_after: Callable[[torch.Tensor | None], torch.Tensor]
    ) -> torch.Tensor:
        """The greedy loop of every decoder: `logits_after(token)` feeds each window its last
        token (None: the prompt) and gives the logits of the next."""
        import torch

        token: torch.Tensor | None = None
        ended = torch.zeros(batch, dtype=torch.bool, device=self._model.device)
        said: list[torch.Tensor] = []
        for step in range(self.max_new_tokens):
            logits = logits_after(token).float()
            logits[:, self._suppress] = -float("inf")
            if step == 0:
                logits[:, self._suppress_first] = -float("inf")
            token = logits.argmax(-1)
            ended |= token == self.eos
            said.append(token.masked_fill(ended, self.pad))  # end-of-text too, as generate()
            if (step + 1) % STOP_CHECK_STEPS == 0 and bool(ended.all()):
                break
        return torch.stack(said, 1)
