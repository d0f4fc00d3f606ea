"""The command line's data files: a dataset read from --input, the result written to --output,
and both paths checked before any work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_input(path: str, split: str | None) -> Any:
    """The dataset in ``path``; ValueError or FileNotFoundError naming --input and the reason."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--input {path}: no such file or directory")
    kind = None
    if not p.is_dir():
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(
            p.suffix.lower()
        )
        if kind is None:
            raise ValueError(
                f"--input {path}: unknown file type {p.suffix!r}; use .jsonl, .json, .csv, .parquet "
                "or a datasets.save_to_disk directory"
            )
        if is_blank(p):
            raise ValueError(f"--input {path}: no rows (the file is empty)")
    try:
        ds = (
            datasets.load_from_disk(str(p))
            if kind is None
            else datasets.load_dataset(kind, data_files=str(p), split="train")
        )
    except Exception as err:
        # the parser's reason, not datasets' "An error occurred while generating"
        # datasets' words for a file with no rows (a CSV header only)
        if "corresponds to no data" in str(err):
            raise ValueError(f"--input {path}: no rows") from None
        raise ValueError(
            f"--input {path}: cannot read it as {kind or 'a saved dataset'} ({reason(err)})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(f"--input {path} holds splits {list(ds)}; choose one with --split")
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"--split {split}: not in {list(ds)}")
        ds = ds[split]
    if len(ds) == 0:
        raise ValueError(f"--input {path}: no rows" + (f" in split {split!r}" if split else ""))
    return ds


def is_blank(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def reason(err: BaseException) -> str:
    from datasets.exceptions import DatasetGenerationError

    while (
        isinstance(err, DatasetGenerationError) and (err.__cause__ or err.__context__) is not None
    ):
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {err}"


OUTPUT_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def check_output(path: str) -> str | None:
    """Why ``--output path`` cannot be written, or None. Found by doing it: missing directories are
    made and the file opened for appending (an existing file is not truncated), then whatever this
    made is removed again."""
    p = Path(path)
    if p.suffix.lower() not in OUTPUT_SUFFIXES:
        return (
            f"--output {path}: unknown file type {p.suffix or '(none)'!r}; use "
            f"{', '.join(OUTPUT_SUFFIXES)}"
        )
    if p.is_dir():
        return f"--output {path}: is a directory"
    return check_directory("--output", p.parent, p)


def check_directory(option: str, directory: Path, file: Path | None = None) -> str | None:
    """Why ``directory`` (and ``file`` in it) cannot be written, or None; leaves no trace."""
    existing = next((d for d in [directory, *directory.parents] if d.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{option} {file or directory}: cannot write there ({existing} is not a directory)"
    made = [d for d in [directory, *directory.parents] if not d.exists()]  # the deepest first
    made_file = False
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if file is not None:
            made_file = not file.exists()
            with open(file, "a"):  # "a": an existing file keeps its contents
                pass
        elif not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot create files in {directory}")
    except OSError as err:
        made_file = False
        return f"{option} {file or directory}: cannot write there ({err})"
    finally:
        if made_file:
            file.unlink(missing_ok=True)
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass
    return None


def write_output(result: Any, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        result.to_csv(path, index=False)
    elif suffix == ".parquet":
        result.to_parquet(path)
    elif suffix == ".json":
        result.to_json(path, lines=False, force_ascii=False)
    elif suffix == ".jsonl":
        result.to_json(path, lines=True, force_ascii=False)
    else:
        raise ValueError(
            f"--output {path}: unknown file type {suffix!r}; use {', '.join(OUTPUT_SUFFIXES)}"
        )
