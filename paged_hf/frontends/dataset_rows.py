"""generate_dataset's rows: prompts and per-row params read from the dataset, records of what
each row gave, and the result dataset assembled from them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Iterator

from ..requests.sampling_params import SamplingParams
from .checkpoint import make_record

logger = logging.getLogger("paged_hf")

# record field -> Arrow type of its output column: ``output_column`` holds the text, and
# ``{output_column}_{field}`` the others, in this order
FEATURES = {
    "text": "string",
    "num_tokens": "int64",
    "finish_reason": "string",
    "ttft": "float64",
    "error": "string",
}


SUFFIXES = tuple(FEATURES)[1:]


READ_BATCH = 256


class Prompts:
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
            return prompt_token_ids(tokenizer, messages, True)
        return prompt_token_ids(tokenizer, prompt, self.messages_column is not None)


def finished_record(engine: Any, tokenizer: Any, row: int, req: Any) -> dict:
    out = engine.collect([req])
    if out.error is not None or out.finish_reason == "error":  # it failed inside a step, alone
        return error_record(row, without_request_id(out.error or "failed in the engine"))
    try:
        # ended by a stop string: the engine's cut text
        if isinstance(out.completions[0].stop_reason, str):
            text = out.text
        else:
            text = (
                decode_text(tokenizer, out.token_ids) if tokenizer is not None else (out.text or "")
            )
    except Exception as e:
        # the tokenizer cannot decode what this row generated: the row fails alone
        return error_record(row, describe(e))
    return make_record(row, text, len(out.token_ids), out.finish_reason, out.ttft, None)


def error_record(row: int, message: str) -> dict:
    error = f"row {row}: {message}"
    logger.warning("paged_hf.generate_dataset: %s", error)
    return make_record(row, "", 0, "error", None, error)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def without_request_id(message: str) -> str:
    """An engine message without its "request <id>: " prefix: the row number replaces the
    auto id, which means nothing to the caller."""
    return re.sub(r"^request [^ ]+: ", "", message)


def dataset_rows(
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
        for batch in view.iter(batch_size=READ_BATCH):
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


def prompt_token_ids(tokenizer: Any, prompt: Any, is_messages: bool) -> list[int]:
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


def params_for_row(base: SamplingParams, row_params: Any, row: int) -> SamplingParams:
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


def decode_text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def assemble(dataset: Any, records: list[dict], output_column: str) -> Any:
    import datasets

    names = output_columns(output_column)
    features = datasets.Features(
        {names[key]: datasets.Value(kind) for key, kind in FEATURES.items()}
    )
    extra = datasets.Dataset.from_dict(
        {names[key]: [r[key] for r in records] for key in FEATURES}, features=features
    )
    if dataset._indices is not None:
        dataset = dataset.flatten_indices()
    if len(dataset) == 0:  # concatenate_datasets(axis=1) drops the new columns of 0-row datasets
        return datasets.Dataset.from_dict(
            {name: [] for name in [*dataset.column_names, *features]},
            features=datasets.Features({**dataset.features, **features}),
        )
    return datasets.concatenate_datasets([dataset, extra], axis=1)


def output_columns(output_column: str) -> dict[str, str]:
    """record field -> its output column"""
    return {"text": output_column, **{s: f"{output_column}_{s}" for s in SUFFIXES}}


def check_columns(
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
    clash = [c for c in output_columns(output_column).values() if c in names]
    if clash:
        raise ValueError(
            f"output_column={output_column!r}: the dataset already has column(s) {clash}; "
            "choose another output_column"
        )
