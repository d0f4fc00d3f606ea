"""The engine's lock: one thread at a time steps the engine or changes its state, and threads take
their turns in the order they asked.

Several threads may wait on one engine (HELM's four threads calling ``model.generate``, a web app's
thread pool, a notebook beside a ``serve()`` engine). Each drives the step loop while it holds the
lock, and lets the next waiter in between steps, so a thread that wants to submit never waits for
another thread's whole call: its rows join the running batch at the next step. Python's own locks
promise no order (a thread that releases and asks again usually wins), which would serialize the
calls; here the lock passes to the longest waiter. Reentrant: a callback run inside a step may
abort a request.
"""

from __future__ import annotations

import threading
from collections import deque


class TurnLock:
    """A reentrant lock handed over first come, first served."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._queue: deque[threading.Event] = deque()  # waiters, longest first

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                self._depth += 1
                return
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return
            turn = threading.Event()
            self._queue.append(turn)
        try:
            turn.wait()
        except BaseException:  # interrupted while waiting (Ctrl-C): give the turn up, or pass it on
            with self._guard:
                if turn.is_set():  # handed to us as we were interrupted
                    self._owner, self._depth = me, 1
                else:
                    self._queue.remove(turn)
                    raise
            self.release()
            raise
        with self._guard:
            self._owner, self._depth = me, 1

    def release(self) -> None:
        with self._guard:
            if self._owner != threading.get_ident():
                raise RuntimeError("TurnLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            self._owner = None
            if self._queue:
                # the next waiter owns it as of now: nobody can take it in between
                self._owner = -1
                self._queue.popleft().set()

    def __reduce__(self) -> tuple:
        # a copied engine (copy.deepcopy of a patched model, TRL's reference model) gets a lock of
        # its own, free
        return (TurnLock, ())

    def __enter__(self) -> "TurnLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
