"""Real weights: SmolLM2-135M-Instruct (bf16) patched vs transformers' own greedy generate."""
from __future__ import annotations

import copy

import torch

import paged_hf
from oracle import teacher_forced_violations

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write one sentence about the sea.", "What color is the sky on a clear day?"]
# bf16 logits of two different (both correct) attention kernels differ by a few 1e-2;
# a wrong cache or mask moves them by whole units.
BF16_TOL = 0.125


def test_smollm2_patched_generate_equals_transformers(smollm2):
    model, tok = smollm2
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    tok.padding_side = "left"
    batch = tok(chats, return_tensors="pt", padding=True)
    patched = paged_hf.patch(copy.deepcopy(model))
    got = patched.generate(**batch, max_new_tokens=24, do_sample=False)
    width = batch["input_ids"].shape[1]
    texts = tok.batch_decode(got[:, width:], skip_special_tokens=True)
    assert "Paris" in texts[0]
    assert "blue" in texts[3].lower()
    exact = 0
    for i, chat in enumerate(chats):
        prompt = tok(chat)["input_ids"]
        gen = got[i, width:].tolist()
        if tok.eos_token_id in gen:
            gen = gen[: gen.index(tok.eos_token_id) + 1]
        assert not teacher_forced_violations(model, prompt, gen, BF16_TOL), texts[i]
        # transformers alone on the unpadded prompt: in bf16 even transformers' own padded batch
        # differs from it on near-ties, so exact agreement is counted, not required everywhere
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        exact += gen == alone
    assert exact >= len(QUESTIONS) // 2, texts
