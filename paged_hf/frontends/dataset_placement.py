"""Where ``generate_dataset``'s rows run: this process's data-parallel shard (``accelerate launch``,
``torchrun``), or under tensor parallelism every row on the model's ranks as one (their rank 0
leading, paged_hf/engine/ranks.py); the checkpoint each writes, and the results gathered in row
order."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..engine.ranks import digest
from .checkpoint import Checkpoint, fingerprint
from .dataset_rows import assemble


def distributed() -> tuple[int, int, Any]:
    """(rank, world size, accelerate PartialState) of this process: its rows are a data-parallel
    shard, except under tensor parallelism, where every process holds part of the one model.

    Without CUDA, PartialState must be told ``cpu=True`` to see a multi-process CPU launch
    (torchrun, or ``accelerate launch --multi_gpu`` on a CPU machine); it then uses gloo.
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(
        cpu=not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    )
    return state.process_index, state.num_processes, state


def tensor_parallel(engine: Any, world: int) -> Any:
    """The engine's tensor-parallel ranks (None without): they run the whole dataset as one, their
    rank 0 leading; a world larger than them (data parallel on top) is refused."""
    ranks = engine.ranks
    if ranks is not None and ranks.size != world:
        raise NotImplementedError(
            f"generate_dataset: the model's tensor parallelism spans {ranks.size} of {world} "
            "processes; data parallel on top of it is not supported yet"
        )
    return ranks


def rows_of(dataset: Any, rank: int, world: int) -> tuple[list[int], Any]:
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


def make_checkpoint(
    directory: Any, what: tuple, rank: int, state: Any, ranks: Any
) -> Checkpoint | None:
    """The run's checkpoint in ``directory`` (None: none), fingerprinted over ``what``
    (checkpoint.fingerprint's arguments); under tensor parallelism the leader's fingerprint (its
    shard's sample of the weights) on every rank."""
    if directory is None:
        return None
    mine = fingerprint(*what) if ranks is None or ranks.is_leader else None
    shared = mine if ranks is None else ranks.share(mine)
    return Checkpoint(Path(directory), shared, rank, state, len(what[3]))


def result_dataset(
    dataset: Any, shard: Any, records: list[dict], rank: int, world: int, output_column: str
) -> Any:
    """Rank 0 (or the only process): the whole dataset with every rank's results, in row order;
    another rank: its own shard with its results."""
    if world > 1:
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        if rank != 0:
            return assemble(shard, records, output_column)
        records = [rec for part in gathered for rec in part]
        assert [r["row_index"] for r in records] == list(range(len(dataset))), (
            "shards lost or reordered rows"
        )
    return assemble(dataset, records, output_column)


def shard_records(
    ranks: Any, engine: Any, run: Callable[[], list[dict]], dataset: Any, base: Any, columns: dict
) -> list[dict]:
    """``run()``'s records: here, or under tensor parallelism the leader's run's, on every rank."""
    if ranks is None:
        return run()
    same = digest(len(dataset), dataset.column_names, base, columns)
    return ranks.run("generate_dataset", same, run, engine.runner)
