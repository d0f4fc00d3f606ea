"""Offline evaluation over a ``datasets.Dataset``: one engine, continuous batching across the
whole dataset, original order, a progress bar, a resumable checkpoint, and sharding under
``accelerate launch``.

    >>> ds = datasets.Dataset.from_dict({"prompt": ["The capital of France is", "1, 2, 3,"]})
    >>> out = paged_hf.generate_dataset(model, tokenizer, ds, sampling_params=SamplingParams(max_new_tokens=16),
    ...                                 checkpoint_dir="runs/eval1")
    >>> out.column_names
    ['prompt', 'generation', 'generation_num_tokens', 'generation_finish_reason', 'generation_ttft']

Checkpoint layout (``checkpoint_dir``):
  manifest.json          what the run was: model, tokenizer, sampling params, columns, dataset
                         fingerprint. A rerun whose arguments differ raises ValueError.
  results-<rank>.jsonl   one line per finished row, ``{"row_index": i, "text": ..., "num_tokens": ...,
                         "finish_reason": ..., "ttft": ..., "error": ...}``, appended as rows finish
                         (written and flushed every step, fsynced about once a second). A rerun
                         reads every results file, skips the rows there, and truncates a torn last
                         line (a run killed mid-write) before appending.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from .sampling_params import SamplingParams

logger = logging.getLogger("paged_hf")

CHECKPOINT_VERSION = 1
_SUFFIXES = ("num_tokens", "finish_reason", "ttft")
_ROW_ID_PREFIX = "paged_hf-row-"
_FSYNC_INTERVAL_S = 1.0
_READ_BATCH = 256


def generate_dataset(model: torch.nn.Module, tokenizer: Any, dataset: Any, prompt_column: str = "prompt",
                     output_column: str = "generation", sampling_params: SamplingParams | None = None,
                     checkpoint_dir: str | os.PathLike | None = None, messages_column: str | None = None,
                     params_column: str | None = None, progress: bool = True, **engine_config: Any) -> Any:
    """Generate one completion per row of ``dataset``; return the dataset with the results added.

    The returned ``datasets.Dataset`` has the original columns in the original order plus
    ``output_column`` (the generated text) and ``{output_column}_num_tokens``,
    ``{output_column}_finish_reason`` ("stop", "length", or "error" for a row whose input was
    refused, e.g. an empty prompt; its text is "") and ``{output_column}_ttft`` (seconds from
    the row entering the engine to its first token).

    - ``prompt_column`` holds text (tokenized with special tokens) or token ids; with
      ``messages_column`` set, that column's chat messages go through
      ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` instead.
    - ``params_column`` holds per-row dicts of ``SamplingParams`` fields, applied over
      ``sampling_params``. When sampling (temperature > 0), row ``i`` without its own seed uses
      seed ``(sampling_params.seed or 0) + i``, so results do not depend on batching, resuming
      or sharding. One completion per row: ``n > 1`` is refused (repeat the rows instead).
    - One engine serves the whole dataset; rows are tokenized and queued as the engine drains
      (about ``2 * max_num_seqs`` waiting at a time), so a 100k-row dataset is never all queued.
      A model patched with ``paged_hf.patch`` uses its engine (``engine_for``) unless
      ``engine_config`` is given; otherwise ``Engine(model, tokenizer, **engine_config)``.
    - ``checkpoint_dir``: finished rows are appended to disk as they complete; a rerun with the
      same arguments skips them and returns the same dataset as an uninterrupted run (the ttft
      of restored rows is the one measured when they ran). Different arguments raise ValueError.
    - Under ``accelerate launch --num_processes K`` (or ``torchrun --nproc_per_node K``) each
      process runs its shard (``datasets.distributed.split_dataset_by_node``) on its own engine;
      rank 0 gathers (``torch.distributed.gather_object``) and returns the whole dataset in the
      original order, the other ranks return their own shard with its results (contiguous rows,
      in order). Put each process's model on its device first (``PartialState().device``).
      Without CUDA the processes join over gloo; note that ``accelerate launch --cpu`` starts
      one process unless MPI is set up, while ``--multi_gpu`` on a machine without GPUs starts K
      CPU processes through torchrun. Checkpoints are shared: each rank appends to
      ``results-<rank>.jsonl`` and reads them all, so a rerun may use a different K.
    """
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(f"generate_dataset takes one split, got a DatasetDict with splits {list(dataset)}; "
                        "pass e.g. dataset['test']")
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"generate_dataset takes a datasets.Dataset, got {type(dataset).__name__}")
    base = SamplingParams() if sampling_params is None else sampling_params
    if not isinstance(base, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(base).__name__}")
    if base.n != 1:
        raise ValueError(f"sampling_params: n={base.n}; generate_dataset makes one completion per row "
                         "(repeat the rows for several samples)")
    _check_columns(dataset, prompt_column, output_column, messages_column, params_column)
    if messages_column is not None and tokenizer is None:
        raise ValueError("messages_column needs a tokenizer with a chat template")

    rank, world, state = _distributed()
    if world > 1:
        from datasets.distributed import split_dataset_by_node

        # the same split applied to a column of row numbers gives each shard row's global index
        numbers = datasets.Dataset.from_dict({"i": list(range(len(dataset)))})
        shard_rows = list(split_dataset_by_node(numbers, rank=rank, world_size=world)["i"])
        shard = split_dataset_by_node(dataset, rank=rank, world_size=world)
        assert len(shard) == len(shard_rows)
    else:
        shard_rows, shard = list(range(len(dataset))), dataset

    checkpoint = None
    if checkpoint_dir is not None:
        fingerprint = _fingerprint(model, tokenizer, dataset, base, prompt_column, output_column,
                                   messages_column, params_column)
        checkpoint = _Checkpoint(Path(checkpoint_dir), fingerprint, rank, state)

    records = _run_shard(model, tokenizer, shard, shard_rows, base, prompt_column, messages_column,
                         params_column, checkpoint, progress and rank == 0, engine_config,
                         desc="paged_hf" if world == 1 else f"paged_hf [rank 0 of {world}]")

    if world > 1:
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        if rank != 0:
            return _assemble(shard, records, output_column)
        records = [rec for part in gathered for rec in part]
        assert [r["row_index"] for r in records] == list(range(len(dataset))), "shards lost or reordered rows"
    return _assemble(dataset, records, output_column)


# ---- the loop ------------------------------------------------------------------------------------

def _run_shard(model: Any, tokenizer: Any, shard: Any, shard_rows: list[int], base: SamplingParams,
               prompt_column: str, messages_column: str | None, params_column: str | None,
               checkpoint: "_Checkpoint | None", progress: bool, engine_config: dict, desc: str) -> list[dict]:
    """Run one shard to completion; its records in shard order (restored rows included)."""
    done: dict[int, dict] = {}
    if checkpoint is not None:
        restored = checkpoint.load()
        done = {i: restored[i] for i in shard_rows if i in restored}
        checkpoint.open()
    engine = _engine(model, tokenizer, engine_config)
    sched = engine.scheduler
    target_waiting = 2 * engine.config.max_num_seqs

    rows = _rows(shard, shard_rows, done, prompt_column, messages_column, params_column)
    live: dict[str, int] = {}  # engine request id -> row index
    bar = _Progress(len(shard_rows), len(done), engine, desc) if progress else None
    exhausted = False
    try:
        while True:
            new: list[dict] = []
            while not exhausted and len(sched.waiting) < target_waiting:
                item = next(rows, None)
                if item is None:
                    exhausted = True
                    break
                row, prompt, row_params = item
                rid = f"{_ROW_ID_PREFIX}{row}"
                try:
                    ids = _prompt_ids(tokenizer, prompt, messages_column is not None, row)
                    params = _row_params(base, row_params, row)
                    engine.add_request(ids, params, request_id=rid)
                except (ValueError, TypeError) as e:  # the row is refused; the others run
                    logger.warning("paged_hf.generate_dataset: %s", e)
                    new.append(_record(row, "", 0, "error", None, str(e)))
                    continue
                live[rid] = row
            if not new and not live and exhausted:
                break
            sampled: dict = {}
            if live:
                sampled, finished = engine.step()
                for req in finished:
                    row = live.pop(req.request_id, None)
                    if row is None:
                        continue  # someone else's request on a shared engine
                    out = engine.collect([req])
                    text = _decode(tokenizer, out.token_ids) if tokenizer is not None else (out.text or "")
                    new.append(_record(row, text, len(out.token_ids), out.finish_reason, out.ttft, None))
            for rec in new:
                done[rec["row_index"]] = rec
            if checkpoint is not None and new:
                checkpoint.write(new)
            if bar is not None:
                bar.update(len(new), len(sampled))
    finally:
        for rid in list(live):  # interrupted: leave a shared engine clean
            try:
                engine.abort(rid)
            except ValueError:
                pass
        if checkpoint is not None:
            checkpoint.close()
        if bar is not None:
            bar.close()
    return [done[i] for i in shard_rows]


def _engine(model: Any, tokenizer: Any, engine_config: dict) -> Any:
    from .engine import Engine
    from .patching import engine_for, is_patched

    if is_patched(model) and not engine_config:
        engine = engine_for(model)
        if engine.requests:
            logger.warning("paged_hf.generate_dataset: the patched model's engine has %d live requests; "
                           "they are stepped along", len(engine.requests))
        return engine
    return Engine(model, tokenizer, **engine_config)


def _rows(shard: Any, shard_rows: list[int], done: dict, prompt_column: str, messages_column: str | None,
          params_column: str | None) -> Iterator[tuple[int, Any, Any]]:
    """(row index, prompt or messages, row params) of the rows still to run, read in batches."""
    source = messages_column or prompt_column
    columns = [source] + ([params_column] if params_column else [])
    todo = [k for k, i in enumerate(shard_rows) if i not in done]
    view = shard.select_columns(columns)
    if len(todo) < len(shard_rows):
        view = view.select(todo)

    def gen() -> Iterator[tuple[int, Any, Any]]:
        k = 0
        for batch in view.iter(batch_size=_READ_BATCH):
            for j, prompt in enumerate(batch[source]):
                yield shard_rows[todo[k]], prompt, batch[params_column][j] if params_column else None
                k += 1
    return gen()


def _prompt_ids(tokenizer: Any, prompt: Any, is_messages: bool, row: int) -> list[int]:
    if is_messages:
        if not prompt:
            raise ValueError(f"row {row}: no chat messages")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template adds its own
    if prompt is None or (isinstance(prompt, str) and not prompt):
        raise ValueError(f"row {row}: empty prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"row {row}: a text prompt needs a tokenizer")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise ValueError(f"row {row}: prompt must be text or token ids, got {type(prompt).__name__}")


def _row_params(base: SamplingParams, row_params: Any, row: int) -> SamplingParams:
    changes: dict[str, Any] = {}
    if row_params is not None:
        if not isinstance(row_params, dict):
            raise ValueError(f"row {row}: params must be a dict of SamplingParams fields, "
                             f"got {type(row_params).__name__}")
        # Arrow fills the keys other rows have with None: those mean "not set"
        changes = {k: v for k, v in row_params.items() if v is not None}
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"row {row}: unknown SamplingParams field(s) {unknown}")
    try:
        params = base.with_(**changes)
    except ValueError as e:
        raise ValueError(f"row {row}: {e}") from None
    if params.n != 1:
        raise ValueError(f"row {row}: n={params.n}; generate_dataset makes one completion per row")
    if not params.is_greedy and "seed" not in changes:
        params = params.with_(seed=(base.seed or 0) + row)  # independent of batching, resume, shards
    return params


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _record(row: int, text: str, num_tokens: int, finish_reason: str | None, ttft: float | None,
            error: str | None) -> dict:
    return {"row_index": row, "text": text, "num_tokens": num_tokens, "finish_reason": finish_reason,
            "ttft": ttft, "error": error}


def _assemble(dataset: Any, records: list[dict], output_column: str) -> Any:
    import datasets

    features = datasets.Features({output_column: datasets.Value("string"),
                                  f"{output_column}_num_tokens": datasets.Value("int64"),
                                  f"{output_column}_finish_reason": datasets.Value("string"),
                                  f"{output_column}_ttft": datasets.Value("float64")})
    extra = datasets.Dataset.from_dict({
        output_column: [r["text"] for r in records],
        f"{output_column}_num_tokens": [r["num_tokens"] for r in records],
        f"{output_column}_finish_reason": [r["finish_reason"] for r in records],
        f"{output_column}_ttft": [r["ttft"] for r in records],
    }, features=features)
    if dataset._indices is not None:
        dataset = dataset.flatten_indices()
    return datasets.concatenate_datasets([dataset, extra], axis=1)


def _check_columns(dataset: Any, prompt_column: str, output_column: str, messages_column: str | None,
                   params_column: str | None) -> None:
    names = dataset.column_names
    source = messages_column or prompt_column
    if source not in names:
        what = "messages_column" if messages_column else "prompt_column"
        raise ValueError(f"{what}={source!r} is not a column of the dataset; columns: {names}")
    if params_column is not None and params_column not in names:
        raise ValueError(f"params_column={params_column!r} is not a column of the dataset; columns: {names}")
    clash = [c for c in [output_column] + [f"{output_column}_{s}" for s in _SUFFIXES] if c in names]
    if clash:
        raise ValueError(f"output_column={output_column!r}: the dataset already has column(s) {clash}; "
                         "choose another output_column")


def _distributed() -> tuple[int, int, Any]:
    """(rank, world size, accelerate PartialState) of this process.

    Without CUDA, PartialState must be told ``cpu=True`` to see a multi-process CPU launch
    (torchrun, or ``accelerate launch --multi_gpu`` on a CPU machine); it then uses gloo.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU"))
    return state.process_index, state.num_processes, state


# ---- progress ------------------------------------------------------------------------------------

class _Progress:
    """tqdm bar over rows, with output tok/s, running/waiting, KV use and prefix-hit rate."""

    def __init__(self, total: int, initial: int, engine: Any, desc: str) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="row", dynamic_ncols=True)
        self.engine = engine
        s = engine.stats()
        self.hit0, self.prompt0 = s["prefix_hit_tokens"], s["prompt_tokens"]
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        if rows:
            self.bar.update(rows)
        now = time.perf_counter()
        if now - self.last < 0.5:
            return
        self.last = now
        s, sched = self.engine.stats(), self.engine.scheduler
        prompt = s["prompt_tokens"] - self.prompt0
        hit = (s["prefix_hit_tokens"] - self.hit0) / prompt if prompt else 0.0
        self.bar.set_postfix({"tok/s": f"{self.tokens / (now - self.start):.0f}",
                              "run": len(sched.running), "wait": len(sched.waiting),
                              "kv": f"{s['blocks_used'] / s['num_blocks']:.0%}", "prefix_hit": f"{hit:.0%}"},
                             refresh=False)

    def close(self) -> None:
        self.last = 0.0
        self.update(0, 0)  # the final numbers, not the last half-second's
        self.bar.close()


# ---- checkpoint ----------------------------------------------------------------------------------

class _Checkpoint:
    def __init__(self, directory: Path, fingerprint: dict, rank: int, state: Any) -> None:
        self.dir = directory
        self.path = directory / f"results-{rank}.jsonl"
        self.file: Any = None
        self.last_sync = 0.0
        world = 1 if state is None else state.num_processes
        manifest = directory / "manifest.json"
        if manifest.exists():  # every rank checks, so every rank raises alike
            _check_manifest(manifest, fingerprint)
        if world > 1:
            state.wait_for_everyone()
        if rank == 0 and not manifest.exists():
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / "manifest.json.tmp"
            with open(tmp, "w") as f:
                json.dump({"version": CHECKPOINT_VERSION, "fingerprint": fingerprint}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, manifest)
        if world > 1:
            state.wait_for_everyone()
        directory.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[int, dict]:
        """Every finished row in every rank's results file; torn or damaged lines are dropped."""
        out: dict[int, dict] = {}
        for path in sorted(self.dir.glob("results-*.jsonl")):
            with open(path, "rb") as f:
                lines = f.read().split(b"\n")
            for k, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    out[int(rec["row_index"])] = rec
                except (ValueError, KeyError, TypeError):
                    if k != len(lines) - 1:  # a torn last line is expected after a kill; others are not
                        logger.warning("paged_hf.generate_dataset: %s line %d is damaged; its row reruns",
                                       path, k + 1)
        return out

    def open(self) -> None:
        """Open this rank's results file for appending, cutting a torn last line first."""
        if self.path.exists():
            with open(self.path, "r+b") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep != len(data):
                    f.truncate(keep)
        self.file = open(self.path, "a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.file.flush()  # in the OS now: survives the process being killed
        now = time.perf_counter()
        if now - self.last_sync >= _FSYNC_INTERVAL_S:  # on the disk: survives the machine going down
            os.fsync(self.file.fileno())
            self.last_sync = now

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None


def _check_manifest(path: Path, fingerprint: dict) -> None:
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"checkpoint {path} is not valid JSON ({e}); delete the checkpoint_dir to start over")
    if saved.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {saved.get('version')!r}, this paged_hf writes "
                         f"{CHECKPOINT_VERSION}; use another checkpoint_dir")
    old = saved.get("fingerprint", {})
    diffs = [f"{key}: {old.get(key)!r} then, {fingerprint.get(key)!r} now"
             for key in sorted(set(old) | set(fingerprint)) if old.get(key) != fingerprint.get(key)]
    if diffs:
        raise ValueError(f"checkpoint_dir {str(path.parent)!r} holds results of a run with different arguments "
                         f"({'; '.join(diffs)}); rerun with the same arguments to resume, or use another "
                         "checkpoint_dir to start over")


def _fingerprint(model: Any, tokenizer: Any, dataset: Any, params: SamplingParams, prompt_column: str,
                 output_column: str, messages_column: str | None, params_column: str | None) -> dict:
    """What makes two runs' rows interchangeable, as plain JSON values."""
    return json.loads(json.dumps({
        "model": _model_fingerprint(model),
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "sampling_params": dataclasses.asdict(params),
        "columns": {"prompt": prompt_column, "output": output_column, "messages": messages_column,
                    "params": params_column},
        "dataset": {"fingerprint": dataset._fingerprint, "num_rows": len(dataset)},
    }, sort_keys=True))


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _model_fingerprint(model: Any) -> dict:
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype",
                                                      "attn_implementation")}
    h = hashlib.sha256()
    with torch.no_grad():  # a sample of every weight: catches a different checkpoint under one name
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
    return {"name_or_path": str(getattr(model, "name_or_path", "") or ""),
            "config": _sha(json.dumps(config, sort_keys=True, default=str)),
            "dtype": str(next(model.parameters()).dtype), "weights_sample": h.hexdigest()[:16]}


def _tokenizer_fingerprint(tokenizer: Any) -> dict | None:
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return {"vocab": _sha(json.dumps(sorted(vocab.items()), ensure_ascii=False)),
            "special_tokens": _sha(json.dumps(getattr(tokenizer, "all_special_tokens", []))),
            "chat_template": _sha(str(getattr(tokenizer, "chat_template", None)))}
