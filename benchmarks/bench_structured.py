"""What structured outputs cost: 64 JSON-extraction prompts on SmolLM2-135M-Instruct (bf16, CPU),
constrained to a JSON schema against the same prompts unconstrained, in one run, rounds
interleaved, medians.

    python benchmarks/bench_structured.py --threads 2
    python benchmarks/bench_structured.py --requests 16 --rounds 1     # quicker

Per system: seconds, output tokens per second, steps, and for the constrained one the grammar
compile time and the mask time per step (``engine.stats()``: ``structured_compile_s``,
``structured_mask_s``), and how many outputs parse as JSON valid under the schema.
"""

from __future__ import annotations

import json
import statistics
import time

import common
import omp_env

OMP_WAIT_POLICY = omp_env.setup()  # before torch: OpenMP reads its wait policy when libgomp loads

import torch  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
NAMES = ["Anna", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Lima", "Accra", "Perth", "Quebec", "Turin"]


def prompts(tokenizer, n: int) -> list[str]:
    out = []
    for i in range(n):
        text = (
            f"{NAMES[i % 8]} is {20 + 7 * i % 60} years old and lives in {CITIES[(3 * i) % 8]}. "
            "Extract the person's name, age and city as JSON."
        )
        chat = [{"role": "user", "content": text}]
        out.append(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    return out


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
        return False
    return isinstance(value["age"], int) and 0 <= value["age"] <= 120


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    common.add_threads(ap)
    ap.add_argument("--json", default="benchmarks/results/structured.json")
    common.add_omp(ap)
    args = common.parse(ap)

    import paged_hf

    model, tok = common.default_model()
    batch = prompts(tok, args.requests)
    n = args.max_new_tokens
    systems = {"unconstrained": paged_hf.SamplingParams(max_new_tokens=n)}
    systems["json_schema"] = paged_hf.SamplingParams(max_new_tokens=n, json_schema=SCHEMA)
    engines = {name: paged_hf.Engine(model, tok, max_num_seqs=64) for name in systems}
    for engine in engines.values():
        engine.warmup()
    rows: dict[str, list[dict]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, params in systems.items():
            engine = engines[name]
            engine.kv_manager.pool.drop_cached()  # every round computes its prompts: no hits from the last one
            before = engine.stats()
            start = time.perf_counter()
            outs = engine.generate(batch, params)
            seconds = time.perf_counter() - start
            after = engine.stats()
            steps = after["steps"] - before["steps"]
            out = sum(len(o.token_ids) for o in outs)
            row = {"seconds": seconds, "output_tokens": out, "steps": steps, "tok_s": out / seconds}
            row["valid_json"] = sum(valid(o.text) for o in outs)
            row["stopped"] = sum(o.finish_reason == "stop" for o in outs)
            mask_s = after.get("structured_mask_s", 0) - before.get("structured_mask_s", 0)
            row["mask_ms_per_step"] = 1000 * mask_s / steps
            rows[name].append(row | {"compile_s": after.get("structured_compile_s", 0.0)})
    print(
        f"\nSmolLM2-135M-Instruct bf16, {torch.get_num_threads()} threads; {args.requests} JSON-extraction prompts, "
        f"max {args.max_new_tokens} new tokens, {args.rounds} rounds, medians\n"
    )
    head = (
        "requests,seconds,output tokens,output tok/s,steps,mask per step,valid JSON,ended by stop"
    )
    med = {
        n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rows.items()
    }
    cells = [
        [n, f"{m['seconds']:.2f}", f"{m['output_tokens']:.0f}", f"{m['tok_s']:.0f}"]
        + [f"{m['steps']:.0f}", f"{m['mask_ms_per_step']:.2f} ms"]
        + [f"{m[k]:.0f} / {args.requests}" for k in ("valid_json", "stopped")]
        for n, m in med.items()
    ]
    print(common.md_table(head.split(","), cells))
    print(
        f"\nconstrained / unconstrained output tok/s: {med['json_schema']['tok_s'] / med['unconstrained']['tok_s']:.2f}x; "
        f"grammar compile (once): {med['json_schema']['compile_s'] * 1000:.0f} ms"
    )
    common.write_json(args.json, {"args": vars(args), "runs": rows})


if __name__ == "__main__":
    main()
