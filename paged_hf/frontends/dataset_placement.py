"""Where ``generate_dataset``'s rows run: this process's data-parallel shard (``accelerate launch``,
``torchrun``); under tensor parallelism the shard of the model's copy, its ranks running it as one
(their rank 0 leading, paged_hf/engine/ranks.py); the checkpoint each shard writes, and the
results gathered in row order."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class Placement:
    """Where this process stands in a ``generate_dataset`` run: its data-parallel shard of the
    rows and, under tensor parallelism, the ranks that hold its copy of the model and run that
    shard as one (their rank 0 leading). World = shards x the ranks of one copy."""

    rank: int  # in the world
    world: int
    state: Any  # accelerate's PartialState
    ranks: Any  # the engine's tensor-parallel ranks, or None
    shard: int
    shards: int

    @property
    def writes(self) -> bool:
        """Whether this process writes its shard's results (a follower's leader does)."""
        return self.ranks is None or self.ranks.is_leader


def placement(engine: Any) -> Placement:
    """This process's place, from the launch and the engine's tensor-parallel ranks."""
    rank, world, state = distributed()
    ranks = engine.ranks
    if ranks is None:
        return Placement(rank, world, state, None, rank, world)
    if ranks.size * ranks.replicas != world:
        raise NotImplementedError(
            f"generate_dataset: {ranks.replicas} copies of the model over {ranks.size} ranks each "
            f"do not make up the {world} processes launched"
        )
    return Placement(rank, world, state, ranks, ranks.replica, ranks.replicas)


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


def make_checkpoint(directory: Any, what: tuple, place: Placement) -> Checkpoint | None:
    """The run's checkpoint in ``directory`` (None: none), fingerprinted over ``what``
    (checkpoint.fingerprint's arguments), one results file a shard; under tensor parallelism the
    leader's fingerprint (its shard of the weights' sample) on every rank."""
    if directory is None:
        return None
    ranks = place.ranks
    mine = fingerprint(*what) if place.writes else None
    shared = mine if ranks is None else ranks.share(mine)
    return Checkpoint(Path(directory), shared, place.shard, place.state, len(what[3]))


def result_dataset(
    dataset: Any, shard: Any, records: list[dict], place: Placement, output_column: str
) -> Any:
    """Rank 0 (or the only process): the whole dataset with every shard's results, in row order;
    another rank: its own shard with its results (under tensor parallelism alone, the whole)."""
    if place.shards > 1:
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * place.world if place.rank == 0 else None
        dist.gather_object(records if place.writes else [], gathered, dst=0)
        if place.rank != 0:
            return assemble(shard, records, output_column)
        records = sorted((rec for part in gathered for rec in part), key=lambda r: r["row_index"])
        assert [r["row_index"] for r in records] == list(range(len(dataset))), (
            "shards lost or repeated rows"
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
