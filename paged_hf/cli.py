"""The ``paged-hf`` command (also ``python -m paged_hf``).

    paged-hf generate --model default --input prompts.jsonl --output out.jsonl --max-new-tokens 64
    paged-hf generate --model ./my-model --input ./saved_dataset --split test --messages-column messages \\
        --output out.jsonl --checkpoint-dir runs/eval1 --temperature 0.7 --top-p 0.9 --seed 1
    paged-hf bench --quick          # the benchmark harness, benchmarks/bench.py (source checkout)
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after "bench" belongs to the harness
        return bench(argv[1:])
    args = _parser().parse_args(argv)
    return args.func(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-hf", description="paged KV + continuous batching for HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for every row of a dataset (ordered, resumable)",
                       description="Generate one completion per row; writes JSON lines with the input columns "
                                   "plus the output column and its _num_tokens, _finish_reason and _ttft.")
    g.add_argument("--model", required=True, help="a transformers model id or directory, or 'default' for the "
                   "embedded SmolLM2-135M-Instruct")
    g.add_argument("--gguf-file", help="load the model from this GGUF file inside --model's directory or repo")
    g.add_argument("--tokenizer", help="tokenizer id or directory (default: the model's)")
    g.add_argument("--dtype", choices=_DTYPES, default="auto", help="model dtype (default: bfloat16 for the "
                   "default model, the checkpoint's own otherwise)")
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--input", required=True, help="a .jsonl/.json/.csv/.parquet file or a datasets.save_to_disk "
                   "directory")
    g.add_argument("--split", help="the split to use when --input holds a DatasetDict")
    g.add_argument("--limit", type=int, help="only the first N rows")
    g.add_argument("--prompt-column", default="prompt")
    g.add_argument("--messages-column", help="a column of chat messages, run through the chat template")
    g.add_argument("--params-column", help="a column of per-row SamplingParams fields (dicts)")
    g.add_argument("--output-column", default="generation")
    g.add_argument("--output", required=True, help="output file: .jsonl (default), .json, .csv or .parquet")
    g.add_argument("--checkpoint-dir", help="append finished rows here; rerun the same command to resume")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--min-new-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, help="row i samples with seed + i")
    s.add_argument("--ignore-eos", action="store_true")
    e = g.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-blocks", type=int)
    e.add_argument("--kv-cache-memory", type=float, help="bytes on CPU, a fraction of free memory on CUDA")
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--backend", choices=("auto", "torch", "flashinfer"))
    e.add_argument("--no-prefix-caching", action="store_true")
    g.set_defaults(func=generate)

    b = sub.add_parser("bench", help="run the benchmark harness (benchmarks/bench.py); arguments pass through")
    b.set_defaults(func=lambda a: bench([]))
    return parser


def generate(args: argparse.Namespace) -> int:
    from .datasets_eval import generate_dataset
    from .sampling_params import SamplingParams

    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed,
                                ignore_eos=args.ignore_eos)
    except ValueError as err:
        return _fail(str(err))
    engine_config = {k: v for k, v in {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size, "num_blocks": args.num_blocks, "max_model_len": args.max_model_len,
        "kv_cache_memory": int(args.kv_cache_memory) if args.kv_cache_memory and args.kv_cache_memory > 1
        else args.kv_cache_memory, "backend": args.backend,
    }.items() if v is not None}
    if args.no_prefix_caching:
        engine_config["enable_prefix_caching"] = False
    try:
        dataset = load_input(args.input, args.split)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    if args.limit is not None:
        dataset = dataset.select(range(min(args.limit, len(dataset))))
    model, tokenizer = load_model(args.model, args.gguf_file, args.tokenizer, args.dtype, args.device)
    try:
        result = generate_dataset(model, tokenizer, dataset, prompt_column=args.prompt_column,
                                  output_column=args.output_column, sampling_params=params,
                                  checkpoint_dir=args.checkpoint_dir, messages_column=args.messages_column,
                                  params_column=args.params_column, progress=not args.no_progress, **engine_config)
    except (ValueError, TypeError) as err:
        return _fail(str(err))
    if result is None or not _is_main_process():
        return 0  # under accelerate launch only rank 0 writes the whole result
    write_output(result, args.output)
    errors = sum(1 for r in result[f"{args.output_column}_finish_reason"] if r == "error")
    print(f"paged-hf: wrote {len(result)} rows to {args.output}"
          + (f" ({errors} refused, finish_reason 'error')" if errors else ""), file=sys.stderr)
    return 0


def load_model(name: str, gguf_file: str | None, tokenizer_name: str | None, dtype: str,
               device: str) -> tuple[Any, Any]:
    import torch

    torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
    if name == "default":
        from .models import load_default_model

        return load_default_model(dtype=torch_dtype or torch.bfloat16, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    model_extra = dict(extra)
    if gguf_file:
        try:  # plain dense weights, which the engine patches (see paged_hf.models)
            from transformers import GgufConfig

            model_extra["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # older transformers always dequantize GGUF
            pass
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype or "auto", **model_extra)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or name, **({} if tokenizer_name else extra))
    return model, tokenizer


def load_input(path: str, split: str | None) -> Any:
    import datasets

    p = Path(path)
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
    elif p.is_file():
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(p.suffix.lower())
        if kind is None:
            raise ValueError(f"--input {path}: unknown file type {p.suffix!r}; use .jsonl, .json, .csv, .parquet "
                             "or a datasets.save_to_disk directory")
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    else:
        raise FileNotFoundError(f"--input {path}: no such file or directory")
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(f"--input {path} holds splits {list(ds)}; choose one with --split")
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"--split {split}: not in {list(ds)}")
        ds = ds[split]
    return ds


def write_output(result: Any, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        result.to_csv(path, index=False)
    elif suffix == ".parquet":
        result.to_parquet(path)
    elif suffix == ".json":
        result.to_json(path, lines=False, force_ascii=False)
    else:
        result.to_json(path, lines=True, force_ascii=False)


def bench_script() -> Path:
    """Where the benchmark harness lives: benchmarks/bench.py beside the package's source."""
    return Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def bench(argv: Sequence[str]) -> int:
    """Run benchmarks/bench.py (in a source checkout) with ``argv``."""
    script = bench_script()
    if not script.is_file():
        return _fail(f"the benchmark harness {script} is not there: `paged-hf bench` runs from a source "
                     "checkout of paged_hf (the wheel does not ship benchmarks/)")
    old_argv = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = old_argv
    return 0


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(message: str) -> int:
    print(f"paged-hf: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
