"""Tensor parallelism on a CPU: one model over two processes (transformers' ``tp_plan="auto"``,
gloo, one thread a rank) against the same model in one process with one and two threads, and what
the leader's step message costs (docs/tensor_parallel.md).

A random Qwen3-0.6B-shaped llama (hidden 1024, 16 query / 8 KV heads, ``--layers`` layers), bf16;
each run patches it, warms up, then times ``model.generate`` on ``--batch`` prompts of
``--prompt-len`` random tokens, ``--new-tokens`` each, ``--repeat`` times (medians); every run's
tokens are compared with the first's. Prints a table, writes JSON.

    python benchmarks/bench_tp.py                     # 12 layers, 8 x 128 prompt tokens, 64 new
    python benchmarks/bench_tp.py --layers 2 --repeat 1 --new-tokens 4 --batch 2   # a smoke run
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

RUNS = (  # (name, ranks, threads a rank, paged_hf's packed CPU linears)
    ("one process, 1 thread", 1, 1, True),
    ("one process, 1 thread, eager linears", 1, 1, False),
    ("one process, 2 threads", 1, 2, True),
    ("tp=2, 1 thread a rank", 2, 1, True),
)
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16)
SHAPE |= dict(num_key_value_heads=8, head_dim=128, vocab_size=32000)


def rank_main(job: dict) -> None:
    """One rank (or the one process) of a run: load, patch, warm up, time the calls."""
    import torch
    from transformers import AutoModelForCausalLM, DistributedConfig

    import paged_hf

    torch.set_num_threads(job["threads"])
    tp = {"distributed_config": DistributedConfig(tp_plan="auto")} if job["ranks"] > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(job["path"], dtype=torch.bfloat16, **tp)
    paged_hf.patch(model, cpu_packed_weights=job["packed"])
    ids = torch.randint(
        10, 32000, (job["batch"], job["prompt_len"]), generator=torch.Generator().manual_seed(1)
    )
    new = job["new_tokens"]
    model.generate(ids[:, :16], max_new_tokens=4)  # warm: kernels, packing
    engine, times = paged_hf.engine_for(model), []
    for _ in range(job["repeat"]):
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        times.append(time.perf_counter() - t0)
    ranks = engine.ranks
    sent = (ranks.steps_sent, ranks.send_s) if ranks else (0, 0.0)
    result = {"seconds": times, "tokens": out[:, ids.shape[1] :].tolist(), "sent": sent}
    Path(f"{job['out']}.rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(result))


def run(job: dict, tmp: Path) -> dict:
    """The run's processes (as torchrun starts them); the leader's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job["out"] = str(tmp / f"out{port}")
    (tmp / "job.json").write_text(json.dumps(job))
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(job["threads"]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-job", str(tmp / "job.json")],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(job["ranks"])},
        )
        for r in range(job["ranks"])
    ]
    if any(p.wait(timeout=job["timeout"]) for p in procs):
        raise SystemExit(f"a rank of {job['name']!r} failed")
    return json.loads(Path(f"{job['out']}.rank0.json").read_text())


def main() -> None:
    ap = common.parser(__doc__)
    for name, default in (
        ("layers", 12),
        ("batch", 8),
        ("prompt-len", 128),
        ("new-tokens", 64),
        ("repeat", 3),
    ):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--timeout", type=float, default=1200, help="seconds a run may take")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    args = ap.parse_args()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as d:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(**SHAPE, num_hidden_layers=args.layers)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(Path(d) / "model")
        for name, ranks, threads, packed in RUNS:
            common.log(f"{name} ...")
            job = vars(args) | dict(
                name=name, path=f"{d}/model", ranks=ranks, threads=threads, packed=packed
            )
            r = results[name] = run(job, Path(d))
            seconds, (steps, send_s) = statistics.median(r["seconds"]), r["sent"]
            rows.append(
                [
                    name,
                    f"{seconds:.2f}",
                    f"{args.batch * args.new_tokens / seconds:.1f}",
                    f"{1e3 * send_s / steps:.2f}" if steps else "-",
                    "yes" if r["tokens"] == results[RUNS[0][0]]["tokens"] else "no",
                ]
            )
    header = ["run", "s (median)", "tok/s", "step message ms (leader)", "tokens as the first run"]
    print(common.md_table(header, rows))
    common.write_json(args.out or common.stamped("bench_tp"), {"args": vars(args), "runs": results})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-job"]:
        if int(os.environ["WORLD_SIZE"]) > 1:
            import torch.distributed

            torch.distributed.init_process_group("gloo")
        rank_main(json.loads(Path(sys.argv[2]).read_text()))
    else:
        main()
