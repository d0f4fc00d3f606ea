"""The embedded default model loads, answers sensibly, and reloads from its cache."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from paged_hf.model.default_model import load_default_model


# Slow: ~15-20 s the first time in a session (the `smollm2` fixture dequantizes the GGUF
# and writes the safetensors cache), ~2 s once the cache exists.
def test_default_model_answers_and_reloads_from_cache(smollm2):
    model, tokenizer = smollm2
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token is not None

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out[0, -1].item() == tokenizer.eos_token_id, "the answer should end with <|im_end|>"

    # from_pretrained records the cache directory it read as name_or_path.
    cache_dir = Path(model.name_or_path).parent
    start = time.perf_counter()
    again, _ = load_default_model(dtype=torch.bfloat16, cache_dir=cache_dir)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"cached load took {elapsed:.1f} s"
    assert again.name_or_path == model.name_or_path
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, model(**inputs).logits)
