"""Offline evaluation over a ``datasets.Dataset``: one engine, continuous batching across the
whole dataset, original order, a progress bar, a resumable checkpoint, and sharding under
``accelerate launch``.

Design notes: docs/internals.md, paged_hf/frontends/dataset_generation.py.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Iterator

import torch

from ..requests.sampling_params import SamplingParams
from .checkpoint import Checkpoint
from .dataset_placement import make_checkpoint, placement, result_dataset, rows_of, shard_records
from .dataset_rows import (
    Prompts,
    check_columns,
    dataset_rows,
    describe,
    error_record,
    finished_record,
    params_for_row,
    without_request_id,
)

logger = logging.getLogger("paged_hf")


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
    # the engine first: its effective max_model_len and EOS ids belong to the checkpoint's
    # fingerprint; under tensor parallelism its ranks run the shard as one (their rank 0 leads)
    engine = _engine(model, tokenizer, engine_config)
    place = placement(engine)
    shard_rows, shard = rows_of(dataset, place.shard, place.shards)
    prompts = Prompts(messages_column, chat, system, json_schema_column)
    columns = {"prompt": prompt_column, "output": output_column, "params": params_column}
    columns.update(prompts.settings())
    what = (model, tokenizer, engine, dataset, base, columns)
    checkpoint = make_checkpoint(checkpoint_dir, what, place)
    run = functools.partial(
        _run_shard,
        engine,
        tokenizer,
        shard,
        shard_rows,
        base,
        prompt_column,
        prompts,
        params_column,
        checkpoint,
        progress and place.rank == 0,
        desc="paged_hf" if place.shards == 1 else f"paged_hf [shard 0 of {place.shards}]",
    )
    records = shard_records(place.ranks, engine, run, shard, base, columns)
    _warn_if_mostly_empty(records, chat)
    return result_dataset(dataset, shard, records, place, output_column)


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
    check_columns(dataset, prompt_column, output_column, messages_column, params_column)
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


# ---- the loop ------------------------------------------------------------------------------------


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
    prompts: Prompts,
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

    rows = dataset_rows(
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
        engine.flush_kv_tiers()
    return [done[i] for i in shard_rows]


def _queue_rows(
    engine: Any,
    tokenizer: Any,
    base: SamplingParams,
    prompts: Prompts,
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
            new.append(finished_record(engine, tokenizer, row, req))
    return len(sampled)


def _submit(
    engine: Any,
    tokenizer: Any,
    base: SamplingParams,
    row: int,
    prompt: Any,
    row_params: Any,
    prompts: Prompts,
    errors: list[dict],
) -> str | None:
    """Queue one row; its engine request id, or None when it failed (its record added to ``errors``)."""
    try:
        ids = prompts.ids(tokenizer, prompt)
        params = params_for_row(base, row_params, row)
    except Exception as e:  # whatever the row's template or tokenizer raise, the row fails alone
        errors.append(error_record(row, describe(e)))
        return None
    try:
        # an auto id: never collides with a shared engine's others
        return engine.add_request(ids, params)
    except (
        ValueError,
        TypeError,
    ) as e:
        # refused at admission; anything else is a bug and propagates
        errors.append(error_record(row, f"{type(e).__name__}: {without_request_id(str(e))}"))
        return None


def _engine(model: Any, tokenizer: Any, engine_config: dict) -> Any:
    from ..model.patching import (  # Engine patches the model if needed
        Engine,
        engine_for,
        is_patched,
    )

    config = dict(engine_config)
    draft = config.pop("draft_model", None)  # the engine drafts with it (num_assistant_tokens)
    if is_patched(model) and not config:
        engine = engine_for(model)
        if draft is not None:
            engine.use_draft_model(draft)
        if tokenizer is not None and engine.tokenizer is None:  # stop strings are read with it
            engine.tokenizer = tokenizer
        if engine.requests:
            logger.warning(
                "paged_hf.generate_dataset: the patched model's engine has %d live requests; "
                "they are stepped along",
                len(engine.requests),
            )
        return engine
    return Engine(model, tokenizer, draft_model=draft, **config)


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
