"""The ``paged-hf`` command (also ``python -m paged_hf``).

Design notes: docs/internals.md, paged_hf/frontends/cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence

from .dataset_files import check_directory, check_output, load_input, write_output

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after "bench" belongs to the harness
        return bench(argv[1:])
    if argv and argv[0] == "lm-eval":  # everything after "lm-eval" belongs to lm-evaluation-harness
        return lm_eval(argv[1:])
    args = _parser().parse_args(argv)
    return args.func(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paged-hf", description="paged KV + continuous batching for HF causal LMs"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="generate a completion for every row of a dataset (ordered, resumable)",
        description="Generate one completion per row; writes the input columns plus the output "
        "column and its _num_tokens, _finish_reason, _ttft and _error. A row that "
        "fails gets finish_reason 'error' and its message in _error; the others run.",
    )
    _add_data_options(g)
    _add_sampling_options(g)
    _add_engine_options(g)
    g.set_defaults(func=generate)

    b = sub.add_parser(
        "bench", help="run the benchmark harness (benchmarks/bench.py); arguments pass through"
    )
    b.set_defaults(func=lambda a: bench([]))
    e = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness's CLI with --model paged_hf available; arguments "
        "pass through (needs the eval extra: pip install 'paged_hf[eval]')",
    )
    e.set_defaults(func=lambda a: lm_eval([]))
    return parser


def _add_data_options(g: argparse.ArgumentParser) -> None:
    """`paged-hf generate`'s model, input and output options."""
    g.add_argument(
        "--model",
        required=True,
        help="a transformers model id or directory, or 'default' for the "
        "embedded SmolLM2-135M-Instruct",
    )
    g.add_argument(
        "--gguf-file", help="load the model from this GGUF file inside --model's directory or repo"
    )
    g.add_argument("--tokenizer", help="tokenizer id or directory (default: the model's)")
    g.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="auto",
        help="model dtype (default: bfloat16 for the "
        "default model, the checkpoint's own otherwise)",
    )
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="shard the model over N ranks with transformers' tensor parallelism (under "
        "torchrun: a multiple of N processes, one copy of the model per N; docs/tensor_parallel.md)",
    )
    g.add_argument(
        "--input",
        required=True,
        help="a .jsonl/.json/.csv/.parquet file or a datasets.save_to_disk directory",
    )
    g.add_argument("--split", help="the split to use when --input holds a DatasetDict")
    g.add_argument("--limit", type=int, help="only the first N rows (N >= 0)")
    g.add_argument(
        "--prompt-column",
        default="prompt",
        help="text prompts go through the tokenizer's chat template "
        "as one user message when it has one (the default; --raw sends them as they are), or token ids",
    )
    g.add_argument(
        "--raw",
        action="store_true",
        help="send --prompt-column's text to the model as it is, without the chat template",
    )
    g.add_argument(
        "--system", metavar="TEXT", help="a system message before each prompt (chat template only)"
    )
    g.add_argument(
        "--messages-column", help="a column of chat messages, run through the chat template"
    )
    g.add_argument("--params-column", help="a column of per-row SamplingParams fields (dicts)")
    g.add_argument("--output-column", default="generation")
    g.add_argument(
        "--output",
        required=True,
        help="output file: .jsonl, .json, .csv or .parquet (checked before anything runs)",
    )
    g.add_argument(
        "--checkpoint-dir", help="append finished rows here; rerun the same command to resume"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_sampling_options(g: argparse.ArgumentParser) -> None:
    """`paged-hf generate`'s sampling and structured-output options."""
    s = g.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--min-new-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, help="row i samples with seed + i")
    s.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: each step a row drafts up to K tokens from its prompt and "
        "output, verified in the step (docs/speculative.md)",
    )
    s.add_argument(
        "--draft-model",
        metavar="NAME",
        help="speculative decoding: a smaller model with the same tokenizer drafts the tokens "
        "(loaded as --model is, with its --dtype and --device; docs/speculative.md)",
    )
    s.add_argument(
        "--num-assistant-tokens",
        type=int,
        default=20,
        metavar="K",
        help="with --draft-model: the longest draft (20, transformers' default)",
    )
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a row when its text contains TEXT (repeatable; escapes like \\n are read)",
    )
    s.add_argument(
        "--include-stop-str",
        action="store_true",
        help="keep the stop string at the end of the text",
    )
    c = g.add_argument_group("structured outputs (one of; needs paged_hf[structured])")
    c.add_argument(
        "--json-schema", metavar="FILE", help="every output is JSON valid under the schema in FILE"
    )
    c.add_argument("--regex", help="every output fully matches this regular expression")
    c.add_argument(
        "--choice", action="append", metavar="TEXT", help="every output is one of these (repeat it)"
    )


def _add_engine_options(g: argparse.ArgumentParser) -> None:
    """`paged-hf generate`'s engine options (EngineConfig fields)."""
    e = g.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-blocks", type=int)
    e.add_argument(
        "--kv-cache-memory", type=float, help="bytes on CPU, a fraction of free memory on CUDA"
    )
    e.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        help="priority: rows run by their --params-column 'priority' (lower first)",
    )
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--backend", choices=("auto", "torch", "flashinfer"))
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--kv-cache-dir",
        help="keep computed prompt KV in this directory and read it back in later runs "
        "(default: $PAGED_HF_KV_CACHE_DIR)",
    )
    e.add_argument("--kv-cache-dir-bytes", type=int, help="the directory's bound (16 GiB)")
    e.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each row's tokens independent of batches and cache hits (CPU, bf16; slower prefill)",
    )


def generate(args: argparse.Namespace) -> int:
    from .dataset_generation import generate_dataset

    # every check that needs no data or model comes first: a mistake costs nothing
    try:
        params, engine_config = _options(args)
    except (ValueError, TypeError, NotImplementedError) as err:
        return _fail(str(err))
    problem = _check_paths(args)
    if problem is not None:
        return _fail(problem)
    try:
        dataset = load_input(args.input, args.split)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    if args.limit is not None:
        dataset = dataset.select(range(min(args.limit, len(dataset))))
    try:
        model, tokenizer = load_model(
            args.model, args.gguf_file, args.tokenizer, args.dtype, args.device, args.tp_size
        )
        if args.draft_model:
            engine_config["draft_model"] = load_model(
                args.draft_model, None, args.tokenizer or args.model, args.dtype, args.device
            )[0]
    except ValueError as err:
        return _fail(str(err))
    try:
        result = generate_dataset(
            model,
            tokenizer,
            dataset,
            prompt_column=args.prompt_column,
            output_column=args.output_column,
            sampling_params=params,
            checkpoint_dir=args.checkpoint_dir,
            messages_column=args.messages_column,
            params_column=args.params_column,
            progress=not args.no_progress,
            chat=False if args.raw else None,
            system=args.system,
            **engine_config,
        )
    except (ValueError, TypeError, OSError) as err:
        return _fail(str(err))
    if result is None or not _is_main_process():
        return 0
    return _write(result, args)


def _options(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The sampling params and engine options the command line asks for; ValueError names a
    wrong one."""
    from ..config import EngineConfig
    from ..requests.sampling_params import SamplingParams

    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be >= 0")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=[_unescape(s) for s in args.stop],
        include_stop_str_in_output=args.include_stop_str,
        regex=args.regex,
        choice=args.choice,
        json_schema=_read_schema(args.json_schema),
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        num_assistant_tokens=args.num_assistant_tokens if args.draft_model else 0,
    )
    params.validate("sampling options")
    memory = args.kv_cache_memory
    engine_config = {
        k: v
        for k, v in {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size,
            "num_blocks": args.num_blocks,
            "max_model_len": args.max_model_len,
            "kv_cache_memory": int(memory) if memory and memory > 1 else memory,
            "backend": args.backend,
            "scheduling_policy": args.scheduling_policy,
            "kv_cache_dir": args.kv_cache_dir,
            "kv_cache_dir_bytes": args.kv_cache_dir_bytes,
        }.items()
        if v is not None
    }
    if args.no_prefix_caching:
        engine_config["enable_prefix_caching"] = False
    if args.batch_invariant:
        engine_config["batch_invariant"] = True
    EngineConfig.from_kwargs(**engine_config)  # the engine checks them again; here it costs nothing
    return params, engine_config


def _check_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with --output or --checkpoint-dir, before any work."""
    if _is_main_process():  # under accelerate launch only rank 0 writes the result
        problem = check_output(args.output)
        if problem is not None:
            return problem
    if args.checkpoint_dir is not None:
        return check_directory("--checkpoint-dir", Path(args.checkpoint_dir))
    return None


def _write(result: Any, args: argparse.Namespace) -> int:
    try:
        write_output(result, args.output)
    except OSError as err:  # checked at the start, but disks fill up and permissions change
        kept = (
            f"; the rows are kept in --checkpoint-dir {args.checkpoint_dir}"
            if args.checkpoint_dir
            else ""
        )
        return _fail(f"--output {args.output}: {err}{kept}")
    errors = sum(1 for r in result[f"{args.output_column}_finish_reason"] if r == "error")
    failed = (
        f" ({errors} failed, finish_reason 'error': see {args.output_column}_error)"
        if errors
        else ""
    )
    print(f"paged-hf: wrote {len(result)} rows to {args.output}{failed}", file=sys.stderr)
    return 0


def _read_schema(path: str | None) -> str | None:
    """--json-schema FILE's text, checked to be JSON (xgrammar checks it is a schema at admission)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
        json.loads(text)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--json-schema {path}: {err}") from None
    return text


def load_model(
    name: str,
    gguf_file: str | None,
    tokenizer_name: str | None,
    dtype: str,
    device: str,
    tp_size: int = 1,
) -> tuple[Any, Any]:
    """(model, tokenizer). Raises ValueError naming the option (--model, --tokenizer, --device,
    --tp-size) whose value cannot be loaded (paged_hf/model/loading.py)."""
    from ..model.loading import load_model as load

    return load(
        name,
        tokenizer=tokenizer_name,
        dtype=dtype,
        device=device,
        gguf_file=gguf_file,
        tp_size=tp_size,
        labels={
            "model": "--model",
            "tokenizer": "--tokenizer",
            "device": "--device",
            "tp_size": "--tp-size",
        },
    )


def bench_script() -> Path:
    """Where the benchmark harness lives: benchmarks/bench.py beside the package's source."""
    return Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def bench(argv: Sequence[str]) -> int:
    """Run benchmarks/bench.py (in a source checkout) with ``argv``."""
    script = bench_script()
    if not script.is_file():
        return _fail(
            f"the benchmark harness {script} is not there: `paged-hf bench` runs from a source "
            "checkout of paged_hf (the wheel does not ship benchmarks/)"
        )
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


def lm_eval(argv: Sequence[str]) -> int:
    """lm-evaluation-harness's own command line (``lm-eval ...``) with the ``paged_hf`` backend
    registered: ``paged-hf lm-eval --model paged_hf --model_args pretrained=PATH ...``."""
    try:
        from ..integrations.lm_eval import run_cli
    except ImportError as err:
        return _fail(f"lm-eval: {err}")
    return run_cli(list(argv))


def _unescape(text: str) -> str:
    """``--stop '\\n\\n'`` as two newlines: a shell passes the backslashes through."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return text


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(message: str) -> int:
    print(f"paged-hf: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
