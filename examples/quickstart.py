"""The main job: SmolLM2-135M-Instruct answers a few chat prompts, through transformers'
own generate and through paged_hf, side by side; then both generate for a workload where
continuous batching matters, with throughput and engine stats.

    make demo          # or: python examples/quickstart.py [--dtype float32] [--max-new-tokens 64]

The dtype (``--dtype auto``, the default) is bfloat16 where this CPU has a bf16 matmul (AVX-512 bf16,
AMX) and float32 elsewhere (AVX2): there torch's bf16 matmul runs at a fifth of its fp32 one, so
transformers would take ~10 minutes over the throughput comparison in bf16, and a comparison should
run each system the way this CPU runs it best.

The throughput comparison: the 8 chats plus 40 more of mixed lengths (short questions, and
requests to summarise or continue passages of 40-400 tokens), each answering until its own EOS
or 128 new tokens, as one ``generate`` call in each system on the same padded batch (what a user
hands transformers). transformers pads the batch to its longest prompt and steps every row until
the last one ends; paged_hf admits rows as the KV pool allows, computes no padding, and retires
each row at its own EOS. Both are warmed up first; each call is timed end to end, once.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import textwrap
import time
from pathlib import Path

# On a machine other jobs share, OpenMP threads spinning between parallel regions stall every one
# of them (docs/backends.md, "On a CPU"); libgomp reads its wait policy once, when torch loads, so it is
# decided here, for transformers and paged_hf alike: PASSIVE when other processes keep a third of
# a core busy over a half-second look (on idle cores it cost paged_hf ~10% here, so not otherwise).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from omp_env import OtherProcesses, others_busy_now  # noqa: E402

if "OMP_WAIT_POLICY" not in os.environ and others_busy_now():
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402

import paged_hf
from paged_hf.execution.cpu import linear as cpu_linear
from paged_hf.model.default_model import load_default_model

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

PASSAGE = (
    "Rivers begin as small streams high in hills and mountains, where rain and melting snow gather into "
    "channels. As they flow downhill they join other streams, growing wider and slower, carrying sand, silt "
    "and stones that they drop when the current weakens. Over thousands of years this slow work carves "
    "valleys, builds flat plains and forms deltas where the river meets the sea. People have always settled "
    "beside rivers: they give fresh water for drinking and farming, fish for food, and a road for boats long "
    "before there were railways or highways. Many of the oldest cities grew on river banks, and floods that "
    "once ruined harvests also left behind the rich soil that made farming possible. Today rivers still "
    "power mills and turbines, cool factories and carry goods, but they also face pollution, dams that block "
    "fish, and water taken faster than rain can replace it. Protecting a river means caring for the whole "
    "land that drains into it, from forests on the hills to fields and towns along the way. Scientists "
    "measure the flow, temperature and life in rivers to learn how healthy they are, and many towns now "
    "restore old channels, plant trees along the banks and remove dams that are no longer needed. "
) * 3
TASKS = [
    "Summarize this passage in two sentences:\n\n{}",
    "List three facts from this text:\n\n{}",
    "Continue this text with one more paragraph:\n\n{}",
    "Write a title for this passage:\n\n{}",
]
SHORT = [
    "What is {} made of?",
    "Tell me a fun fact about {}.",
    "Explain {} to a child.",
    "Write a limerick about {}.",
]
TOPICS = [
    "glass",
    "honey",
    "the moon",
    "chess",
    "clouds",
    "paper",
    "volcanoes",
    "penguins",
    "bread",
    "music",
]


def more_chats(n: int = 40) -> list[str]:
    """Mixed lengths: short questions, and tasks over passages of 40-400 words (seeded, no randomness at run time)."""
    words = PASSAGE.split()
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(SHORT[i // 2 % len(SHORT)].format(TOPICS[i // 2 % len(TOPICS)]))
        else:
            # 40..399 words, spread out, each from its own place in the text
            cut = 40 + (i * 83) % 360
            start = (i * 131) % (len(words) - 400)
            out.append(TASKS[i // 2 % len(TASKS)].format(" ".join(words[start : start + cut])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: bfloat16 where this CPU has a bf16 matmul, else float32",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--batch-new-tokens",
        type=int,
        default=128,
        help="new tokens at most per row in the "
        "throughput comparison (each row stops at its EOS before that)",
    )
    ap.add_argument(
        "--extra-chats",
        type=int,
        default=40,
        help="chats added to the 8 for the throughput comparison",
    )
    args = ap.parse_args()

    if args.dtype == "auto":
        # in hardware: oneDNN emulates it on other AVX-512 CPUs
        native_bf16 = cpu_linear.native_bf16()
        args.dtype = "bfloat16" if native_bf16 else "float32"
        if not native_bf16:
            print(
                "dtype float32: this CPU has no bf16 matmul (no AVX-512 bf16 or AMX), where torch's bf16 matmul "
                "runs at a fifth of fp32's (--dtype bfloat16 to compare in bf16 anyway)"
            )
    model, tok = load_default_model(dtype=getattr(torch, args.dtype))
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    tok.padding_side = "left"
    batch = tok(chats, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    many = chats + [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in more_chats(args.extra_chats)
    ]
    big = tok(many, return_tensors="pt", padding=True)
    big_kw = dict(max_new_tokens=args.batch_new_tokens, do_sample=False)

    model.generate(**tok(chats[:2], return_tensors="pt", padding=True), max_new_tokens=4)  # warm-up
    hf_out = model.generate(**batch, **gen_kw)
    t0 = time.perf_counter()
    with OtherProcesses() as hf_others:
        hf_big = model.generate(**big, **big_kw)
    hf_time = time.perf_counter() - t0

    paged_hf.patch(model, tokenizer=tok)  # one line; same generate calls below
    # warm-up (KV cache, kernel)
    model.generate(**tok(chats[:2], return_tensors="pt", padding=True), max_new_tokens=4)
    ph_out = model.generate(**batch, **gen_kw)
    t0 = time.perf_counter()
    with OtherProcesses() as ph_others:
        ph_big = model.generate(**big, **big_kw)
    ph_time = time.perf_counter() - t0

    def answers(out: torch.Tensor) -> list[str]:
        return tok.batch_decode(out[:, width:], skip_special_tokens=True)

    def n_tokens(out: torch.Tensor, width: int) -> int:
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
    print(
        f"\n{same}/{len(QUESTIONS)} answers identical to transformers' greedy generate ({args.dtype})"
    )
    hf_rows, ph_rows = hf_out[:, width:].tolist(), ph_out[:, width:].tolist()
    bw = big["input_ids"].shape[1]
    hf_tok, ph_tok = n_tokens(hf_big, bw), n_tokens(ph_big, bw)
    lens = big["attention_mask"].sum(1)
    print(
        f"\nthroughput: {len(many)} chats (prompts {int(lens.min())}-{int(lens.max())} tokens), each until its EOS "
        f"or {args.batch_new_tokens} new tokens, one generate call each ({torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')}):"
    )
    print(
        f"  transformers generate: {hf_tok} tokens in {hf_time:.2f}s = {hf_tok / hf_time:.1f} tok/s"
    )
    print(
        f"  paged_hf generate:     {ph_tok} tokens in {ph_time:.2f}s = {ph_tok / ph_time:.1f} tok/s "
        f"({(ph_tok / ph_time) / (hf_tok / hf_time):.2f}x)"
    )
    busy = _busy_note(hf_others.cores, ph_others.cores)
    if busy:
        print(busy)
    stats = paged_hf.engine_for(model).stats()
    print(
        "engine stats:",
        ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()),
    )
    paged_hf.unpatch(model)
    if same < len(QUESTIONS):
        print(where_answers_part(model, tok, chats, hf_rows, ph_rows))


def where_answers_part(
    model, tok, chats: list[str], hf_rows: list[list[int]], ph_rows: list[list[int]]
) -> str:
    """For each answer that differs, the first token where it does, judged by a float32 forward
    of the model (unpadded) on the common prefix: how far apart the two tokens' logits are, and
    which one float32 picks. In bf16 the two systems round differently (padding, batch shapes),
    so greedy answers part where two tokens are almost tied; after that the texts follow their
    own tokens."""
    fp32 = copy.deepcopy(model).float()
    gaps, fp32_picks_ours = [], 0
    for chat, a, b in zip(chats, hf_rows, ph_rows):
        k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
        if k is None:
            continue
        prompt = tok(chat)["input_ids"]  # as the batch was tokenized, without its padding
        with torch.no_grad():
            logits = fp32(torch.tensor([prompt + a[:k]])).logits[0, -1]
        gaps.append(abs(logits[a[k]] - logits[b[k]]).item())
        fp32_picks_ours += bool(logits[b[k]] > logits[a[k]])
    if not gaps:
        return ""
    return (
        f"  where they part: {len(gaps)} answer(s) first differ at a token whose two candidates' float32 logits are "
        f"{min(gaps):.2f}-{max(gaps):.2f} apart (logits here are ~10-30), i.e. near-ties; float32 picks "
        f"paged_hf's token in {fp32_picks_ours} of {len(gaps)}"
    )


def _busy_note(*others: float | None) -> str | None:
    """A warning when other processes took CPU time during either timing: then both numbers,
    and paged_hf's most (many small ops, each waiting for a descheduled thread), mean little."""
    known = [c for c in others if c is not None]
    if not known or max(known) < 0.25:
        return None
    return (
        f"  note: other processes kept {max(known):.1f} CPU cores busy during the timings: they are not "
        "reliable; run again on a quiet machine"
    )


if __name__ == "__main__":
    main()
