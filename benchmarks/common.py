"""What the benchmarks share: their common options (torch threads, OpenMP's wait policy), the
default model and the tiny one smoke runs use, timing and statistics, Markdown tables, and the
JSON each one writes.

Nothing here imports torch when this module loads: a benchmark sets OpenMP's wait policy
(``omp_env.setup()``, read once when torch loads libgomp) before torch is imported, and may import
this module before that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))  # paged_hf from this checkout


# ---- the command line ---------------------------------------------------------------------------
def parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by a docstring: its first paragraph, then the rest as the epilog."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(
        description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_threads(p: argparse.ArgumentParser, default: int | None = None, help: str = "") -> None:
    p.add_argument("--threads", type=int, default=default, help=help or "torch threads")


def add_omp(p: argparse.ArgumentParser) -> None:
    """``--omp-wait-policy``, which omp_env.setup() reads from the command line before torch loads."""
    import omp_env

    p.add_argument(
        "--omp-wait-policy",
        choices=omp_env.CHOICES,
        default="auto",
        help="OpenMP's wait policy (default auto: PASSIVE when the machine is busy; see omp_env.py)",
    )


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; torch's threads set where ``--threads`` gives a number."""
    args = p.parse_args(argv)
    set_threads(getattr(args, "threads", None))
    return args


def set_threads(n: int | None) -> None:
    """torch's threads, where ``n`` is a number (None leaves torch's own)."""
    if n:
        import torch

        torch.set_num_threads(n)


# ---- models -------------------------------------------------------------------------------------
def dtype(name):
    """torch's dtype for "bf16" / "fp32" or for torch's own name ("bfloat16", "float32")."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(name) or getattr(torch, name)


def default_model(dtype_name: str = "bf16"):
    """(model, tokenizer): SmolLM2-135M-Instruct's real weights, paged_hf's default model."""
    from paged_hf.model.default_model import load_default_model

    return load_default_model(dtype=dtype(dtype_name))


def cache_dir() -> Path:
    """Where paged_hf caches models ($PAGED_HF_CACHE, else ~/.cache/paged_hf)."""
    import os

    return Path(os.environ.get("PAGED_HF_CACHE") or "~/.cache/paged_hf").expanduser()


def special_ids(tok) -> set[int]:
    """The tokenizer's special and added ids (no prompt of random ids draws them)."""
    return set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}) or {})


def tiny_llama(dtype):
    """(model, special ids, pad id): a 2-layer random llama (tied embeddings like SmolLM2) for the
    smoke runs; ids 0-3 are special."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    init = dict(initializer_range=0.15, tie_word_embeddings=True, max_position_embeddings=1024)
    cfg = LlamaConfig(**sizes, **heads, **ids, **init)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval(), {0, 1, 2, 3}, 0


def eval_metrics(result: dict, task: str) -> dict:
    """A task's metrics in an lm-eval result, by name (their stderr left out)."""
    got = result["results"][task].items()
    return {k.split(",")[0]: float(v) for k, v in got if "," in k and "stderr" not in k}


# ---- timing and statistics ----------------------------------------------------------------------
def seconds(fn, repeats: int = 7, min_time: float = 0.0) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` timed runs, after a warm-up call; each run
    calls it as many times as take ``min_time`` (once for 0)."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - t0 < min_time / 4:
        fn()
        calls += 1
    calls = max(1, int(min_time * calls / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def medians(runs: dict) -> dict:
    """Each key's median over its list of runs."""
    return {k: statistics.median(v) for k, v in runs.items()}


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile, linearly interpolated (numpy's default); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---- output -------------------------------------------------------------------------------------
def log(msg: str) -> None:
    """A progress line, on stderr: stdout keeps the results."""
    print(msg, file=sys.stderr, flush=True)


def md_table(header: list, rows: list[list], align: list[str] | None = None) -> str:
    """A Markdown table; ``align`` gives the separator's cells ("---" each by default)."""
    lines = [header, align or ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(c) for c in cells) + " |" for cells in lines)


def text_table(cells: list[list[str]], left: int = 1) -> str:
    """Columns padded to their widest cell (the first ``left`` flush left), a rule under the header."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )
        for row in cells
    ]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def stamped(name: str, directory: str | Path = RESULTS) -> Path:
    """``directory/<name>-<date>-<time>.json`` (benchmarks/results/ by default)."""
    return Path(directory) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def write_json(path: str | Path, data, indent: int = 1) -> Path:
    """Write ``data`` as JSON (parents made; what JSON cannot hold as its str) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str))
    print(f"JSON: {path}")
    return path
