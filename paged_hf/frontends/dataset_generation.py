"""Offline evaluation over a ``datasets.Dataset``: one engine, continuous batching across the
whole dataset, original order, a progress bar, a resumable checkpoint, and sharding under
``accelerate launch``.

Design notes: docs/internals.md, paged_hf/frontends/dataset_generation.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from ..requests.sampling_params import SamplingParams
from .checkpoint import Checkpoint, fingerprint, make_record

logger = logging.getLogger("paged_hf")

# record field -> Arrow type of its output column: ``output_column`` holds the text, and
# ``{output_column}_{field}`` the others, in this order
_FEATURES = {
    "text": "string",
    "num_tokens": "int64",
    "finish_reason": "string",
    "ttft": "float64",
    "error": "string",
}
_SUFFIXES = tuple(_FEATURES)[1:]
_READ_BATCH = 256


def generate_dataset(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Any,
    prompt_column: str = "prompt",
    output_column: str = "generation",
    sampling_params: SamplingParams | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    messages_column: str | None = None,
    params_column: str | None = None,
    progress: bool = True,
    chat: bool | None = None,
    system: str | None = None,
    json_schema: dict | str | None = None,
    json_schema_column: str | None = None,
    **engine_config: Any,
) -> Any:
    """Generate one completion per row of ``dataset``; return the dataset with the results added.

    The result keeps the original columns and order and adds ``output_column`` (the text) and its
    ``_num_tokens``, ``_finish_reason``, ``_ttft`` and ``_error`` columns; a row fails alone and the
    others run. Prompts and chat templates, per-row params and schemas, checkpoints and resuming,
    sharding under ``accelerate launch``: docs/usage.md, "generate_dataset in full".
    """
    base, chat = _checked_arguments(
        dataset,
        tokenizer,
        sampling_params,
        prompt_column,
        output_column,
        messages_column,
        params_column,
        json_schema,
        json_schema_column,
        chat,
        system,
    )
    rank, world, state = _distributed()
    shard_rows, shard = _shard(dataset, rank, world)

    # the engine first: its effective max_model_len and EOS ids belong to the checkpoint's fingerprint
    engine = _engine(model, tokenizer, engine_config)
    prompts = _Prompts(messages_column, chat, system, json_schema_column)
    checkpoint = None
    if checkpoint_dir is not None:
        columns = {"prompt": prompt_column, "output": output_column, "params": params_column}
        columns.update(prompts.settings())
        checkpoint = Checkpoint(
            Path(checkpoint_dir),
            fingerprint(model, tokenizer, engine, dataset, base, columns),
            rank,
            state,
            len(dataset),
        )
    records = _run_shard(
        engine,
        tokenizer,
        shard,
        shard_rows,
        base,
        prompt_column,
        prompts,
        params_column,
        checkpoint,
        progress and rank == 0,
        desc="paged_hf" if world == 1 else f"paged_hf [rank 0 of {world}]",
    )
    _warn_if_mostly_empty(records, chat)

    return _gathered(dataset, shard, records, rank, world, output_column)


def _checked_arguments(
    dataset: Any,
    tokenizer: Any,
    sampling_params: SamplingParams | None,
    prompt_column: str,
    output_column: str,
    messages_column: str | None,
    params_column: str | None,
    json_schema: dict | str | None,
    json_schema_column: str | None,
    chat: bool | None,
    system: str | None,
) -> tuple[SamplingParams, bool]:
    """The run's base params and whether prompts go through the chat template; a mistake in
    the arguments raises before any work, naming it."""
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"generate_dataset takes one split, got a DatasetDict with splits {list(dataset)}; "
            "pass e.g. dataset['test']"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"generate_dataset takes a datasets.Dataset, got {type(dataset).__name__}")
    base = SamplingParams() if sampling_params is None else sampling_params
    if not isinstance(base, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(base).__name__}")
    if base.n != 1:
        raise ValueError(
            f"sampling_params: n={base.n}; generate_dataset makes one completion per row "
            "(repeat the rows for several samples)"
        )
    _check_columns(dataset, prompt_column, output_column, messages_column, params_column)
    if json_schema_column is not None and json_schema_column not in dataset.column_names:
        raise ValueError(
            f"json_schema_column {json_schema_column!r} is not a column of the dataset "
            f"({dataset.column_names})"
        )
    if messages_column is not None and tokenizer is None:
        raise ValueError("messages_column needs a tokenizer with a chat template")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ValueError(
            "chat=True: the tokenizer has no chat template (pass chat=False to send prompts raw)"
        )
    if system is not None and not (chat is not False and has_template):
        raise ValueError(
            "system= needs prompts sent through a chat template (a tokenizer with one, chat not False)"
        )
    chat = has_template and messages_column is None and chat is not False
    if json_schema is not None:
        base = base.with_(json_schema=json_schema)

    return base, chat


def _shard(dataset: Any, rank: int, world: int) -> tuple[list[int], Any]:
    """This process's rows: their global indices, and the shard."""
    if world == 1:
        return list(range(len(dataset))), dataset
    import datasets
    from datasets.distributed import split_dataset_by_node

    # the same split applied to a column of row numbers gives each shard row's global index
    numbers = datasets.Dataset.from_dict({"i": list(range(len(dataset)))})
    shard_rows = list(split_dataset_by_node(numbers, rank=rank, world_size=world)["i"])
    shard = split_dataset_by_node(dataset, rank=rank, world_size=world)
    assert len(shard) == len(shard_rows)
    return shard_rows, shard


def _gathered(
    dataset: Any, shard: Any, records: list[dict], rank: int, world: int, output_column: str
) -> Any:
    """Rank 0 (or the only process): the whole dataset with every rank's results, in row order;
    another rank: its own shard with its results."""
    if world > 1:
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        if rank != 0:
            return _assemble(shard, records, output_column)
        records = [rec for part in gathered for rec in part]
        assert [r["row_index"] for r in records] == list(range(len(dataset))), (
            "shards lost or reordered rows"
        )
    return _assemble(dataset, records, output_column)


# ---- the loop ------------------------------------------------------------------------------------


class _Prompts:
    """How a row's prompt becomes token ids, and which extra column it reads."""

    def __init__(
        self,
        messages_column: str | None,
        chat: bool,
        system: str | None,
        json_schema_column: str | None,
    ):
        self.messages_column, self.chat, self.system = messages_column, chat, system
        self.json_schema_column = json_schema_column

    def settings(self) -> dict[str, Any]:
        """What a checkpoint's fingerprint records of them."""
        return {
            "messages": self.messages_column,
            "chat": self.chat,
            "system": self.system,
            "json_schema": self.json_schema_column,
        }

    def ids(self, tokenizer: Any, prompt: Any) -> list[int]:
        if self.chat and isinstance(prompt, str) and prompt:
            messages = (
                [{"role": "system", "content": self.system}] if self.system is not None else []
            ) + [{"role": "user", "content": prompt}]
            return _prompt_ids(tokenizer, messages, True)
        return _prompt_ids(tokenizer, prompt, self.messages_column is not None)


def _warn_if_mostly_empty(records: list[dict], chat: bool) -> None:
    ran = [r for r in records if r["finish_reason"] != "error"]
    short = [r for r in ran if r["num_tokens"] <= 2 and r["finish_reason"] == "stop"]
    if ran and len(short) * 2 > len(ran):
        cause = (
            (
                "the prompts went to the model raw: an instruction-tuned model usually needs its chat template "
                "(chat=None or True; the CLI without --raw)"
            )
            if not chat
            else "the model ends its answer at once (a base model given a chat template? try chat=False / --raw)"
        )
        logger.warning(
            "paged_hf.generate_dataset: %d of %d rows ended within two tokens; likely cause: %s",
            len(short),
            len(ran),
            cause,
        )


def _run_shard(
    engine: Any,
    tokenizer: Any,
    shard: Any,
    shard_rows: list[int],
    base: SamplingParams,
    prompt_column: str,
    prompts: _Prompts,
    params_column: str | None,
    checkpoint: Checkpoint | None,
    progress: bool,
    desc: str,
) -> list[dict]:
    """Run one shard to completion; its records in shard order (restored rows included)."""
    done: dict[int, dict] = {}
    if checkpoint is not None:
        restored = checkpoint.load()  # every record is checked here, before any row runs
        done = {i: restored[i] for i in shard_rows if i in restored}
        checkpoint.open()
    # this loop steps the engine itself: look for replaced tensors now
    engine.check_weights(rescan=True)
    target_waiting = 2 * engine.config.max_num_seqs

    rows = _rows(
        shard,
        shard_rows,
        done,
        prompt_column,
        prompts.messages_column,
        params_column,
        prompts.json_schema_column,
    )
    live: dict[str, int] = {}  # engine request id -> row index
    bar = _Progress(len(shard_rows), len(done), engine, desc) if progress else None
    more = True
    try:
        while True:
            new: list[dict] = []
            if more:
                more = _queue_rows(
                    engine, tokenizer, base, prompts, rows, live, new, target_waiting
                )
            if not new and not live and not more:
                break
            sampled = _step_rows(engine, tokenizer, live, new) if live else 0
            for rec in new:
                done[rec["row_index"]] = rec
            if checkpoint is not None and new:
                checkpoint.write(new)
            if bar is not None:
                bar.update(len(new), sampled)
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


def _queue_rows(
    engine: Any,
    tokenizer: Any,
    base: SamplingParams,
    prompts: _Prompts,
    rows: Iterator,
    live: dict[str, int],
    new: list[dict],
    target: int,
) -> bool:
    """Submit rows until ``target`` wait in the engine (a row refused at once goes to ``new``);
    False once the rows are exhausted."""
    while len(engine.scheduler.waiting) < target:
        item = next(rows, None)
        if item is None:
            return False
        row, prompt, row_params = item
        rid = _submit(engine, tokenizer, base, row, prompt, row_params, prompts, new)
        if rid is not None:
            live[rid] = row
    return True


def _step_rows(engine: Any, tokenizer: Any, live: dict[str, int], new: list[dict]) -> int:
    """One engine step: the rows it finished go to ``new``; returns the tokens it sampled."""
    sampled, finished = engine.step()
    for req in finished:
        row = live.pop(req.request_id, None)
        if row is not None:  # else someone else's request on a shared engine
            new.append(_finished_record(engine, tokenizer, row, req))
    return len(sampled)


def _submit(
    engine: Any,
    tokenizer: Any,
    base: SamplingParams,
    row: int,
    prompt: Any,
    row_params: Any,
    prompts: _Prompts,
    errors: list[dict],
) -> str | None:
    """Queue one row; its engine request id, or None when it failed (its record added to ``errors``)."""
    try:
        ids = prompts.ids(tokenizer, prompt)
        params = _row_params(base, row_params, row)
    except Exception as e:  # whatever the row's template or tokenizer raise, the row fails alone
        errors.append(_error_record(row, _describe(e)))
        return None
    try:
        # an auto id: never collides with a shared engine's others
        return engine.add_request(ids, params)
    except (
        ValueError,
        TypeError,
    ) as e:
        # refused at admission; anything else is a bug and propagates
        errors.append(_error_record(row, f"{type(e).__name__}: {_without_request_id(str(e))}"))
        return None


def _finished_record(engine: Any, tokenizer: Any, row: int, req: Any) -> dict:
    out = engine.collect([req])
    if out.error is not None or out.finish_reason == "error":  # it failed inside a step, alone
        return _error_record(row, _without_request_id(out.error or "failed in the engine"))
    try:
        # ended by a stop string: the engine's cut text
        if isinstance(out.completions[0].stop_reason, str):
            text = out.text
        else:
            text = _decode(tokenizer, out.token_ids) if tokenizer is not None else (out.text or "")
    except Exception as e:
        # the tokenizer cannot decode what this row generated: the row fails alone
        return _error_record(row, _describe(e))
    return make_record(row, text, len(out.token_ids), out.finish_reason, out.ttft, None)


def _error_record(row: int, message: str) -> dict:
    error = f"row {row}: {message}"
    logger.warning("paged_hf.generate_dataset: %s", error)
    return make_record(row, "", 0, "error", None, error)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _without_request_id(message: str) -> str:
    """An engine message without its "request <id>: " prefix: the row number replaces the
    auto id, which means nothing to the caller."""
    return re.sub(r"^request [^ ]+: ", "", message)


def _engine(model: Any, tokenizer: Any, engine_config: dict) -> Any:
    from ..model.patching import (  # Engine patches the model if needed
        Engine,
        engine_for,
        is_patched,
    )

    if is_patched(model) and not engine_config:
        engine = engine_for(model)
        if tokenizer is not None and engine.tokenizer is None:  # stop strings are read with it
            engine.tokenizer = tokenizer
        if engine.requests:
            logger.warning(
                "paged_hf.generate_dataset: the patched model's engine has %d live requests; "
                "they are stepped along",
                len(engine.requests),
            )
        return engine
    return Engine(model, tokenizer, **engine_config)


def _rows(
    shard: Any,
    shard_rows: list[int],
    done: dict,
    prompt_column: str,
    messages_column: str | None,
    params_column: str | None,
    json_schema_column: str | None = None,
) -> Iterator[tuple[int, Any, Any]]:
    """(row index, prompt or messages, row params) of the rows still to run, read in batches; a
    row's schema (``json_schema_column``) joins its params."""
    source = messages_column or prompt_column
    columns = (
        [source]
        + ([params_column] if params_column else [])
        + ([json_schema_column] if json_schema_column else [])
    )
    todo = [k for k, i in enumerate(shard_rows) if i not in done]
    view = shard.select_columns(columns)
    if len(todo) < len(shard_rows):
        view = view.select(todo)

    def gen() -> Iterator[tuple[int, Any, Any]]:
        k = 0
        for batch in view.iter(batch_size=_READ_BATCH):
            for j, prompt in enumerate(batch[source]):
                row_params = batch[params_column][j] if params_column else None
                schema = batch[json_schema_column][j] if json_schema_column else None
                if schema is not None:
                    row_params = {
                        **(row_params if isinstance(row_params, dict) else {}),
                        "json_schema": schema,
                    }
                yield shard_rows[todo[k]], prompt, row_params
                k += 1

    return gen()


def _prompt_ids(tokenizer: Any, prompt: Any, is_messages: bool) -> list[int]:
    if is_messages:
        if not prompt:
            raise ValueError("no chat messages")
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        # the template adds its own
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prompt is None or (isinstance(prompt, str) and not prompt):
        raise ValueError("empty prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise ValueError(f"prompt must be text or token ids, got {type(prompt).__name__}")


def _row_params(base: SamplingParams, row_params: Any, row: int) -> SamplingParams:
    changes: dict[str, Any] = {}
    if row_params is not None:
        if not isinstance(row_params, dict):
            raise ValueError(
                f"params must be a dict of SamplingParams fields, got {type(row_params).__name__}"
            )
        # Arrow fills the keys other rows have with None: those mean "not set"
        changes = {k: v for k, v in row_params.items() if v is not None}
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s) {unknown}")
    params = base.with_(**changes)
    if params.n != 1:
        raise ValueError(f"n={params.n}; generate_dataset makes one completion per row")
    if not params.is_greedy and "seed" not in changes:
        # independent of batching, resume, shards
        params = params.with_(seed=(base.seed or 0) + row)
    return params


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _assemble(dataset: Any, records: list[dict], output_column: str) -> Any:
    import datasets

    names = _output_columns(output_column)
    features = datasets.Features(
        {names[key]: datasets.Value(kind) for key, kind in _FEATURES.items()}
    )
    extra = datasets.Dataset.from_dict(
        {names[key]: [r[key] for r in records] for key in _FEATURES}, features=features
    )
    if dataset._indices is not None:
        dataset = dataset.flatten_indices()
    if len(dataset) == 0:  # concatenate_datasets(axis=1) drops the new columns of 0-row datasets
        return datasets.Dataset.from_dict(
            {name: [] for name in [*dataset.column_names, *features]},
            features=datasets.Features({**dataset.features, **features}),
        )
    return datasets.concatenate_datasets([dataset, extra], axis=1)


def _output_columns(output_column: str) -> dict[str, str]:
    """record field -> its output column"""
    return {"text": output_column, **{s: f"{output_column}_{s}" for s in _SUFFIXES}}


def _check_columns(
    dataset: Any,
    prompt_column: str,
    output_column: str,
    messages_column: str | None,
    params_column: str | None,
) -> None:
    names = dataset.column_names
    source = messages_column or prompt_column
    if source not in names:
        what = "messages_column" if messages_column else "prompt_column"
        raise ValueError(f"{what}={source!r} is not a column of the dataset; columns: {names}")
    if params_column is not None and params_column not in names:
        raise ValueError(
            f"params_column={params_column!r} is not a column of the dataset; columns: {names}"
        )
    clash = [c for c in _output_columns(output_column).values() if c in names]
    if clash:
        raise ValueError(
            f"output_column={output_column!r}: the dataset already has column(s) {clash}; "
            "choose another output_column"
        )


def _distributed() -> tuple[int, int, Any]:
    """(rank, world size, accelerate PartialState) of this process.

    Without CUDA, PartialState must be told ``cpu=True`` to see a multi-process CPU launch
    (torchrun, or ``accelerate launch --multi_gpu`` on a CPU machine); it then uses gloo.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(
        cpu=not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    )
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
        self.bar.set_postfix(
            {
                "tok/s": f"{self.tokens / (now - self.start):.0f}",
                "run": len(sched.running),
                "wait": len(sched.waiting),
                "kv": f"{s['blocks_used'] / s['num_blocks']:.0%}",
                "prefix_hit": f"{hit:.0%}",
            },
            refresh=False,
        )

    def close(self) -> None:
        self.last = 0.0
        self.update(0, 0)  # the final numbers, not the last half-second's
        self.bar.close()
