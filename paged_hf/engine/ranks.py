"""Tensor parallelism: one schedule for every rank.

A model loaded with transformers' tensor parallelism (``tp_plan``) runs each layer's heads
spread over the ranks of a process group, and every forward is a collective. Each rank patches
its model and calls the same front end with the same arguments (SPMD, as under ``torchrun``).
Rank 0 of the group, the leader, runs the engine as on one device: it admits, schedules, samples
and runs the callbacks. Before each forward it sends the others, the followers, what the forward
reads (paged_hf/requests/forward_row.py) over a gloo group of its own, and their runners run the
same forward on their own heads with the leader's pages. When the call ends the leader sends its
result (or its error), which every rank returns (or raises).

Nothing on a follower reads a clock or a queue, so the ranks cannot drift apart; and a rank that
stops answering fails the others' next message within ``timeout_s``, naming it, instead of a hang.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, fields, is_dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..cache.stable_keys import hash_tensor
from ..requests.forward_row import ForwardRow

if TYPE_CHECKING:
    from ..execution.runner import ModelRunner
    from ..requests.request import Request

logger = logging.getLogger("paged_hf")


@dataclass
class _Step:
    rows: list[ForwardRow]
    block_copies: list[tuple[int, int]]


@dataclass
class _Finished:
    result: Any


@dataclass
class _Failed:
    error: BaseException | None
    message: str


class RankError(RuntimeError):
    """A collective of the tensor-parallel ranks failed: a rank stopped, or the ranks disagree."""


class Ranks:
    """This process's place among the ranks one model is spread over, and their messages."""

    def __init__(
        self, group: Any, wire: Any, timeout_s: float, replica: tuple[int, int] = (0, 1)
    ) -> None:
        import torch.distributed as dist

        self.group, self.wire, self.timeout_s = group, wire, timeout_s
        # which of the world's copies of the model these ranks hold, of how many (data parallel)
        self.replica, self.replicas = replica
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.members = dist.get_process_group_ranks(group)
        self.leader = self.members[0]
        self._depth = 0  # calls in progress on this thread's stack (an inner call is part of it)
        self.broken: str | None = None  # why the model's process group was given up, if it was
        self.steps_sent, self.send_s = 0, 0.0  # the leader's step messages and their time
        self._owner: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def stats(self, kv_heads: int, whole_kv_heads: int | None) -> dict[str, Any]:
        """This rank's place and the leader's step messages; whether each rank holds the whole
        KV (a plan that does not shard k / v: ``kv_heads`` this rank's, of the model's whole)."""
        return {
            "rank": self.rank,
            "ranks": self.size,
            "copy": self.replica,
            "copies": self.replicas,
            "kv_heads": kv_heads,
            "whole_kv_on_every_rank": kv_heads == whole_kv_heads,
            "step_messages": self.steps_sent,
            "step_message_s": self.send_s,
        }

    # ---- messages ------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        self._broadcast(message)

    def _receive(self) -> Any:
        return self._broadcast(None)

    def _broadcast(self, message: Any) -> Any:
        import torch.distributed as dist

        box = [message]
        try:
            dist.broadcast_object_list(box, src=self.leader, group=self.wire)
        except Exception as e:  # noqa: BLE001 - said with who is missing
            why = (
                f"the ranks stopped at a failed step ({self.broken}); restart every rank"
                if self.broken is not None
                else f"lost the leader or a follower (global ranks {self.members}) within "
                f"{self.timeout_s:g} s: {e}"
            )
            raise RankError(
                f"paged_hf tensor parallelism: rank {self.rank} of {self.size}: {why}"
            ) from e
        return box[0]

    def lead_step(
        self,
        scheduled: list[tuple[Request, int]],
        copies: list[tuple[int, int]],
        forward: Callable[[], Any],
    ) -> Any:
        """The leader's forward: first what every follower's runner needs to run it too."""
        if not self._depth:  # no follower is listening
            raise NotImplementedError(
                "paged_hf tensor parallelism: steps run inside a call made alike on every rank "
                "(model.generate, Engine.generate / score / score_rolling / beam_search / warmup); "
                "serve(), run_until_done and stepping by hand are not supported yet"
            )
        t0 = time.perf_counter()
        self._send(_Step([ForwardRow.of(req, n) for req, n in scheduled], list(copies)))
        self.steps_sent, self.send_s = self.steps_sent + 1, self.send_s + time.perf_counter() - t0
        return self._forward(forward)

    def _forward(self, forward: Callable[[], Any]) -> Any:
        """A forward on this rank. One that raises leaves the others inside its collectives: the
        model's group is destroyed so theirs fail at once instead of at its timeout (where it is
        the whole world's, with every group), and the ranks stop taking calls: the group cannot be
        mended in these processes."""
        import torch.distributed as dist

        try:
            return forward()
        except Exception as e:
            self.broken = f"rank {self.rank}: a forward failed: {type(e).__name__}: {e}"
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001, S110 - already gone with the peer that failed
                pass
            raise

    def share(self, value: Any) -> Any:
        """The leader's ``value`` on every rank (what only the leader can compute alike)."""
        return self._broadcast(value if self.is_leader else None)

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pages every rank can hold)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.wire)
        return int(t.item())

    def agree(self, what: str, digest: str) -> None:
        """Every rank called ``what`` with the same arguments, or every rank raises naming those
        that differ from the leader's."""
        import torch.distributed as dist

        digests: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(digests, digest, group=self.wire)
        except Exception as e:  # noqa: BLE001
            raise RankError(
                f"paged_hf tensor parallelism: {what}: a rank did not answer: {e}"
            ) from e
        differ = [self.members[r] for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise ValueError(
                f"paged_hf tensor parallelism: {what} was called with other arguments on rank(s) "
                f"{differ} than on rank {self.leader}; every rank of a model's copy calls it "
                "alike (SPMD)"
            )

    # ---- one call over the ranks -----------------------------------------------------------
    def run(self, what: str, digest: str, call: Callable[[], Any], runner: ModelRunner) -> Any:
        """``call`` on the leader, the leader's forwards on the followers; its result everywhere."""
        me = threading.get_ident()
        if self._depth:
            if self._owner != me:
                raise NotImplementedError(
                    f"paged_hf tensor parallelism: {what} from a second thread while a call runs: "
                    "the ranks follow one call at a time"
                )
            return call()  # part of the call in progress
        if self.broken is not None:
            raise RankError(
                f"paged_hf tensor parallelism: {what}: the ranks stopped at a failed step "
                f"({self.broken}); restart every rank"
            )
        self.agree(what, digest)
        self._depth, self._owner = 1, me
        try:
            return self._lead(call) if self.is_leader else self._follow(what, runner)
        finally:
            self._depth, self._owner = 0, None

    def _lead(self, call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except BaseException as e:
            self._send(_Failed(_picklable(e), f"{type(e).__name__}: {e}"))
            raise
        self._send(_Finished(result))
        return result

    def _follow(self, what: str, runner: ModelRunner) -> Any:
        """Run the leader's forwards until its call ends. A forward that fails here gives up the
        model's group, so the leader's fails too; this rank goes on listening until the leader's
        call ends, so that every rank ends it alike (each with RankError where the group was the
        whole world's and the messages went with it)."""
        while True:
            message = self._receive()
            if isinstance(message, _Step) and self.broken is None:
                rows = [(row, len(row.tokens)) for row in message.rows]
                try:
                    self._forward(lambda: runner.execute(rows, message.block_copies))
                except Exception:  # noqa: BLE001 - said, and the leader's result says the rest
                    logger.exception("paged_hf: %s", self.broken)
            elif isinstance(message, _Step):
                continue  # the group is gone: the leader's forward fails too
            elif isinstance(message, _Finished):
                return message.result
            else:
                if message.error is not None:
                    raise message.error
                raise RuntimeError(f"{what} failed on rank 0: {message.message}")


def _picklable(error: BaseException) -> BaseException | None:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - sent as its message instead
        return None


def digest(*values: Any) -> str:
    """A digest of a call's arguments that is equal on ranks called alike: tensors by their bytes,
    containers by their items, callbacks by their type."""
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"T{v.dtype}{tuple(v.shape)}".encode())
            hash_tensor(h, v)
        elif isinstance(v, (str, int, float, bool, bytes, type(None))):
            h.update(f"{type(v).__name__}:{v!r};".encode())
        elif isinstance(v, dict):
            h.update(b"{")
            for k in sorted(v, key=repr):
                feed(k)
                feed(v[k])
            h.update(b"}")
        elif isinstance(v, (list, tuple, set, frozenset)):
            h.update(f"{type(v).__name__}[".encode())
            for x in sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v:
                feed(x)
            h.update(b"]")
        elif is_dataclass(v) and not isinstance(v, type):
            h.update(type(v).__qualname__.encode())
            feed({f.name: getattr(v, f.name) for f in fields(v)})
        else:  # a callback, a config object: its type (its state is the caller's to keep alike)
            h.update(f"<{type(v).__module__}.{type(v).__qualname__}>".encode())

    for v in values:
        feed(v)
    return h.hexdigest()


def over_ranks(what: str) -> Callable:
    """A front end's method run over the engine's ranks (``self`` is the engine) where it has any."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            ranks = self.ranks
            if ranks is None:
                return method(self, *args, **kwargs)
            return ranks.run(
                what, digest(args, kwargs), lambda: method(self, *args, **kwargs), self.runner
            )

        return run

    return wrap


def make_ranks(group: Any, timeout_s: float) -> Ranks | None:
    """The ranks of ``group`` (a model's tensor-parallel process group), with a gloo group of
    their own for the leader's messages; None for a group of one. Every rank of the world calls
    this together (creating a group is a collective of the whole world)."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return None
    mine = dist.get_process_group_ranks(group)
    # every tensor-parallel group of the world, so each rank creates the same groups in order
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = sorted({tuple(m) for m in everyone})
    wire = None
    for members in groups:
        created = dist.new_group(
            list(members), backend="gloo", timeout=timedelta(seconds=timeout_s)
        )
        if list(members) == mine:
            wire = created
    return Ranks(group, wire, timeout_s, (groups.index(tuple(mine)), len(groups)))


def ranks_for(group: Any, config: Any, stateful: bool, device: torch.device) -> Ranks | None:
    """The engine's ranks where its model is sharded over ``group``; what the leader cannot yet
    send its followers is refused by name."""
    if group is None:
        return None
    refused = [
        why
        for why, applies in (
            (
                f"a {device.type} device (tensor parallelism is checked on CPUs so far)",
                device.type != "cpu",
            ),
            ("preemption_mode='swap'", config.preemption_mode == "swap"),
            ("a model with recurrent or convolution state (a hybrid)", stateful),
            ("compile_decode", bool(config.compile_decode)),
        )
        if applies
    ]
    if refused:
        raise NotImplementedError(
            "paged_hf: under tensor parallelism these are not supported yet: " + "; ".join(refused)
        )
    return make_ranks(group, config.tp_timeout_s)
