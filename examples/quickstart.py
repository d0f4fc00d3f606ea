"""The main job: SmolLM2-135M-Instruct answers a few chat prompts, through transformers'
own generate and through paged_hf, side by side, with throughput and engine stats.

    make demo          # or: python examples/quickstart.py [--dtype float32] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import textwrap
import time

import torch

import paged_hf
from paged_hf.models import load_default_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Give me a short tip for staying focused.",
    "What is the boiling point of water in Celsius?",
    "Write a haiku about autumn.",
    "Why is the sky blue? Answer in one sentence.",
    "What is a prime number?",
    "Suggest a name for a friendly robot.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    model, tok = load_default_model(dtype=getattr(torch, args.dtype))
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    tok.padding_side = "left"
    batch = tok(chats, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    t0 = time.perf_counter()
    hf_out = model.generate(**batch, **gen_kw)
    hf_time = time.perf_counter() - t0

    paged_hf.patch(model, tokenizer=tok)  # one line; same generate call below
    model.generate(**tok(chats[:1], return_tensors="pt"), max_new_tokens=2)  # warm-up (allocates the KV cache)
    t0 = time.perf_counter()
    ph_out = model.generate(**batch, **gen_kw)
    ph_time = time.perf_counter() - t0

    def answers(out: torch.Tensor) -> list[str]:
        return tok.batch_decode(out[:, width:], skip_special_tokens=True)

    def n_tokens(out: torch.Tensor) -> int:
        """Generated tokens up to and including each row's EOS (the rest is padding)."""
        total = 0
        for row in out[:, width:].tolist():
            total += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        return total

    same = 0
    for q, a, b in zip(QUESTIONS, answers(hf_out), answers(ph_out)):
        same += a == b
        print(f"\nQ: {q}")
        print(textwrap.indent(textwrap.fill(b.strip(), 96), "  paged_hf:     "))
        if a != b:
            print(textwrap.indent(textwrap.fill(a.strip(), 96), "  transformers: "))
    print(f"\n{same}/{len(QUESTIONS)} answers identical to transformers' greedy generate "
          f"({args.dtype}; bf16 near-ties can flip a token)")
    hf_tok, ph_tok = n_tokens(hf_out), n_tokens(ph_out)
    print(f"transformers generate: {hf_tok} tokens in {hf_time:.2f}s = {hf_tok / hf_time:.1f} tok/s")
    print(f"paged_hf generate:     {ph_tok} tokens in {ph_time:.2f}s = {ph_tok / ph_time:.1f} tok/s "
          f"({hf_time / ph_time:.2f}x)")
    stats = paged_hf.engine_for(model).stats()
    print("engine stats:", ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
