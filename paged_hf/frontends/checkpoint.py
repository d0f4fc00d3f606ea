"""The resumable checkpoint of ``generate_dataset``: a manifest that says what the run was, and
one results file per rank that finished rows are appended to.

Design notes: docs/internals.md, paged_hf/frontends/checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from ..cache.coherence import local_shard
from ..cache.stable_keys import hash_tensor

logger = logging.getLogger("paged_hf")

CHECKPOINT_VERSION = 2  # 2: the engine's max_model_len and EOS ids joined the fingerprint
FINISH_REASONS = ("stop", "length", "abort", "error")
RECORD_FIELDS = ("row_index", "text", "num_tokens", "finish_reason", "ttft", "error")
_FSYNC_INTERVAL_S = 1.0


def make_record(
    row: int, text: str, num_tokens: int, finish_reason: str, ttft: float | None, error: str | None
) -> dict:
    return {
        "row_index": row,
        "text": text,
        "num_tokens": num_tokens,
        "finish_reason": finish_reason,
        "ttft": ttft,
        "error": error,
    }


def record_problem(rec: Any, num_rows: int) -> str | None:
    """Why ``rec`` is not a record of a dataset of ``num_rows`` rows; None when it is one."""
    if not isinstance(rec, dict):
        return f"a record is a JSON object, this is {type(rec).__name__}"
    missing = [k for k in RECORD_FIELDS if k not in rec]
    if missing:
        return f"field(s) {missing} missing"
    row, num_tokens, reason, ttft, error = (
        rec[k] for k in ("row_index", "num_tokens", "finish_reason", "ttft", "error")
    )
    if not _is_int(row) or not 0 <= row < num_rows:
        return f"row_index={row!r}, must be an int in [0, {num_rows})"
    if not isinstance(rec["text"], str):
        return f"text is {type(rec['text']).__name__}, must be a str"
    if not _is_int(num_tokens) or num_tokens < 0:
        return f"num_tokens={num_tokens!r}, must be an int >= 0"
    if not isinstance(reason, str) or reason not in FINISH_REASONS:
        return f"finish_reason={reason!r}, must be one of {list(FINISH_REASONS)}"
    if ttft is not None and not (_is_number(ttft) and math.isfinite(ttft) and ttft >= 0):
        return f"ttft={ttft!r}, must be a number >= 0 or null"
    if error is not None and not isinstance(error, str):
        return f"error is {type(error).__name__}, must be a str or null"
    if (error is not None) != (reason == "error"):
        return f"finish_reason={reason!r} with error={error!r}: a message goes with finish_reason 'error' only"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Checkpoint:
    """One rank's view of a checkpoint directory: checks (or, on rank 0, writes) the manifest on
    creation, ``load`` reads what every shard finished, ``open`` / ``write`` / ``close`` append this
    shard's rows (one file a data-parallel shard; under tensor parallelism its leader writes)."""

    def __init__(
        self, directory: Path, fingerprint: dict, shard: int, state: Any, num_rows: int
    ) -> None:
        self.dir = directory
        self.path = directory / f"results-{shard}.jsonl"
        self.num_rows = num_rows
        self.file: Any = None
        self.last_sync = 0.0
        world = 1 if state is None else state.num_processes
        manifest = directory / "manifest.json"
        if manifest.exists():  # every rank checks, so every rank raises alike
            check_manifest(manifest, fingerprint)
        if world > 1:
            state.wait_for_everyone()
        if (state is None or state.process_index == 0) and not manifest.exists():
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / "manifest.json.tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {"version": CHECKPOINT_VERSION, "fingerprint": fingerprint},
                    f,
                    indent=1,
                    sort_keys=True,
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, manifest)
        if world > 1:
            state.wait_for_everyone()
        directory.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict[int, dict]:
        """The rows done, from every rank's results file: row index -> its first good record.
        Rows with only error records are left out, so they run again."""
        done: dict[int, dict] = {}
        for path in sorted(self.dir.glob("results-*.jsonl")):
            for rec in self._records(path):
                if rec["finish_reason"] != "error":
                    done.setdefault(rec["row_index"], rec)
        return done

    def _records(self, path: Path) -> Iterator[dict]:
        """The valid records of one results file; the others are logged and skipped."""
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                if k != len(lines) - 1:  # a torn last line is expected after a kill; others are not
                    logger.warning(
                        "paged_hf.generate_dataset: %s line %d is not JSON; its row runs again",
                        path,
                        k + 1,
                    )
                continue
            problem = record_problem(rec, self.num_rows)
            if problem is not None:
                logger.warning(
                    "paged_hf.generate_dataset: %s line %d is not a valid record (%s); its row runs "
                    "again",
                    path,
                    k + 1,
                    problem,
                )
                continue
            yield make_record(*(rec[key] for key in RECORD_FIELDS))  # only the known fields

    def open(self) -> None:
        """Open this rank's results file for appending, after mending its last line: one cut short
        (invalid JSON) is cut off, a complete one whose newline never got written gets it."""
        if self.path.exists():
            with open(self.path, "r+b") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep != len(data):
                    if _is_json(data[keep:]):
                        f.write(b"\n")  # at the end: read() left the position there
                    else:
                        f.truncate(keep)
        self.file = open(self.path, "a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        self.file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.file.flush()  # in the OS now: survives the process being killed
        now = time.perf_counter()
        # on the disk: survives the machine going down
        if now - self.last_sync >= _FSYNC_INTERVAL_S:
            os.fsync(self.file.fileno())
            self.last_sync = now

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return False
    return True


def check_manifest(path: Path, fingerprint: dict) -> None:
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(
            f"checkpoint {path} is not valid JSON ({e}); delete the checkpoint_dir to start over"
        )
    if not isinstance(saved, dict) or saved.get("version") != CHECKPOINT_VERSION:
        version = saved.get("version") if isinstance(saved, dict) else None
        raise ValueError(
            f"checkpoint {path} has format version {version!r}, this paged_hf writes "
            f"{CHECKPOINT_VERSION}; use another checkpoint_dir"
        )
    old = saved.get("fingerprint", {})
    diffs = [
        f"{key}: {old.get(key)!r} then, {fingerprint.get(key)!r} now"
        for key in sorted(set(old) | set(fingerprint))
        if old.get(key) != fingerprint.get(key)
    ]
    if diffs:
        raise ValueError(
            f"checkpoint_dir {str(path.parent)!r} holds results of a run with different arguments "
            f"({'; '.join(diffs)}); rerun with the same arguments to resume, or use another "
            "checkpoint_dir to start over"
        )


def fingerprint(
    model: Any, tokenizer: Any, engine: Any, dataset: Any, params: Any, columns: dict
) -> dict:
    """What makes two runs' rows interchangeable, as plain JSON values. The engine's part is what
    changes results: where generation is cut (max_model_len) and which tokens end it."""
    return json.loads(
        json.dumps(
            {
                "model": _model_fingerprint(model),
                "tokenizer": _tokenizer_fingerprint(tokenizer),
                "engine": {
                    "max_model_len": int(engine.max_model_len),
                    "eos_token_ids": sorted(int(t) for t in engine.eos_token_ids),
                },
                "sampling_params": {
                    **dataclasses.asdict(params),
                    "logits_processors": [  # callables: by name
                        f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', type(f).__qualname__)}"
                        for f in params.logits_processors
                    ],
                },
                "columns": columns,
                "dataset": {"fingerprint": dataset._fingerprint, "num_rows": len(dataset)},
            },
            sort_keys=True,
        )
    )


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _model_fingerprint(model: Any) -> dict:
    config = {
        k: v
        for k, v in model.config.to_dict().items()
        if not k.startswith("_")
        and k not in ("transformers_version", "dtype", "torch_dtype", "attn_implementation")
    }
    h = hashlib.sha256()
    with torch.no_grad():  # a sample of every weight: catches a different checkpoint under one name
        for name, p in model.named_parameters():
            h.update(name.encode())
            # a tensor-parallel weight: this rank's shard (the leader's fingerprint is shared)
            p = local_shard(p)
            hash_tensor(h, p.detach().reshape(-1)[:16].float())
    return {
        "name_or_path": str(getattr(model, "name_or_path", "") or ""),
        "config": _sha(json.dumps(config, sort_keys=True, default=str)),
        "dtype": str(next(model.parameters()).dtype),
        "weights_sample": h.hexdigest()[:16],
    }


def _tokenizer_fingerprint(tokenizer: Any) -> dict | None:
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    return {
        "vocab": _sha(json.dumps(sorted(vocab.items()), ensure_ascii=False)),
        "special_tokens": _sha(json.dumps(getattr(tokenizer, "all_special_tokens", []))),
        "chat_template": _sha(str(getattr(tokenizer, "chat_template", None))),
    }
