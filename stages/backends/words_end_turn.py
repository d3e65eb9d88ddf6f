"""Whether the caller's words so far finish what they were saying: a small chat LM's
probability that a sentence ends next.

semantic_vad's sound model (gateway.turns.smart_turn, Smart Turn) hears intonation; on flat or
synthetic voices it also hears a finished question in "What time does the train". The words
tell those apart: after the user's words (their trailing punctuation taken off, since the
recognizer adds it from the same sound), a chat model puts a sentence end (".", "?", "!", or
the end of the user's message) next with a probability near 0 when the sentence is cut off
("How many legs" 0.000) and from about 0.2 when it is whole ("How many legs does a spider
have" 0.88, with SmolLM2-135M-Instruct). This is what LiveKit's turn detector does with a
fine-tuned model of that size; the bundled chat model (`bundled:smollm2-135m-instruct`) does it
untuned.

The encoder stage judges the words at the caller's pause (TURN_PAUSED), where it transcribes
the turn so far anyway, and sends the probability with that transcript; the gateway weighs it
with the sound (gateway.session.turns). One forward pass of the words after the template's
cached start: about 100 ms on one core (60 on two) for 135 M parameters, a few ms on a GPU.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from stages.backends.speech import load_error, torch_device

logger = logging.getLogger(__name__)

SENTENCE_ENDS = frozenset(".?!")
_TRAILING = " \t\n.?!,;:…-"


class WordsEndTurn:
    """A causal chat LM (any Hugging Face one with a chat template) judging whether words end
    a turn."""

    def __init__(self, model: Any, tokenizer: Any, device: Any, name: str) -> None:
        import torch

        self.model, self.tokenizer, self.device, self.name = model, tokenizer, device, name
        self._torch = torch
        self.end_ids = torch.tensor(sorted(sentence_end_ids(tokenizer)), device=device)
        # The template up to the user's words (a default system prompt included) is the same
        # every time: its KV cache is made once, and a judgement runs the words alone, a third
        # of the tokens.
        self._prefix = self.prompt_ids("X")[:-1]
        with torch.inference_mode():
            out = model(torch.tensor([self._prefix], device=device), use_cache=True)
        self._prefix_cache = out.past_key_values

    def probability(self, text: str) -> float | None:
        """The probability that the user's message ends a sentence after ``text``; None when
        there are no words to judge."""
        words = text.strip().rstrip(_TRAILING)
        if not words:
            return None
        ids = self.prompt_ids(words)
        torch = self._torch
        n = len(self._prefix)
        with torch.inference_mode():
            if ids[:n] == self._prefix and len(ids) > n:
                cache = copy.deepcopy(self._prefix_cache)
                tail = torch.tensor([ids[n:]], device=self.device)
                out = self.model(tail, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:  # the words merged with the template's last token: the whole prompt
                out = self.model(torch.tensor([ids], device=self.device), logits_to_keep=1)
            p = torch.softmax(out.logits[0, -1].float(), dim=-1)[self.end_ids].sum()
        return float(p)

    def prompt_ids(self, words: str) -> list[int]:
        """The chat prompt of a user message that is ``words`` so far: the template up to the
        end of the words (no end of message after them)."""
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": words}], tokenize=False
        )
        cut = rendered.rindex(words) + len(words)
        return self.tokenizer(rendered[:cut], add_special_tokens=False)["input_ids"]


def sentence_end_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokens that end a sentence: those that are sentence-final punctuation alone
    (with or without spaces), and the end of a message (the template's and the model's)."""
    ends = set()
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id]).strip()
        if piece and set(piece) <= SENTENCE_ENDS:
            ends.add(token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id >= 0:
            ends.add(token_id)
    if tokenizer.eos_token_id is not None:
        ends.add(tokenizer.eos_token_id)
    return ends


def load_words_end_turn(model: str, device: str = "cpu") -> WordsEndTurn:
    """Load the chat LM ``model`` (a local folder or a cached Hugging Face id) on ``device``:
    float32 on the CPU, bfloat16 on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    on = torch_device(device, "end-of-turn words model")
    dtype = torch.float32 if on.type == "cpu" else torch.bfloat16
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(on).eval()
    except Exception as exc:
        raise load_error("end-of-turn words model", model, exc) from exc
    if tokenizer.chat_template is None:
        raise load_error(
            "end-of-turn words model", model, ValueError("its tokenizer has no chat template")
        )
    judge = WordsEndTurn(lm, tokenizer, on, model)
    judge.probability("Hello there")  # the first pass allocates; not on a caller's pause
    logger.info(
        "end-of-turn words model %s on %s ready in %.1f s", model, device, time.monotonic() - t0
    )
    return judge
