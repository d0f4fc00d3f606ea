"""Module-level functions of transformers' modeling files that paged_hf's CPU kernels answer for,
during engine steps only.

Design notes: docs/internals.md, paged_hf/execution/cpu/kernel_seams.py.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator

Site = tuple[str, str]  # (python module, name)

_lock = threading.Lock()
_installed: dict[Site, list] = {}  # site -> [steps using it, the original]
_local = threading.local()


@contextlib.contextmanager
def installed(sites: list[Site], wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """``wrap(original)`` under each site's name while the block runs."""
    taken = []
    try:
        with _lock:
            for site in sites:
                entry = _installed.get(site)
                if entry is None:
                    module = sys.modules[site[0]]
                    original = getattr(module, site[1])
                    entry = _installed[site] = [0, original]
                    setattr(module, site[1], wrap(original))
                entry[0] += 1
                taken.append(site)
        yield
    finally:
        with _lock:
            for site in taken:
                entry = _installed[site]
                entry[0] -= 1
                if entry[0] == 0:
                    setattr(sys.modules[site[0]], site[1], entry[1])
                    del _installed[site]


@contextlib.contextmanager
def switch(name: str, value: Any) -> Iterator[None]:
    """This thread's setting ``name`` (read by the wrappers with ``setting``) within the block."""
    before = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, before)


def setting(name: str) -> Any:
    return getattr(_local, name, None)


def functions_named(module_of: Any, name: str, params: tuple[str, ...]) -> list[Site]:
    """The sites in the python module that defines ``type(module_of)`` holding a function called
    ``name`` (transformers' kernel decorators keep the name) that takes ``params``."""
    import inspect

    python_module = sys.modules.get(type(module_of).__module__)
    found = []
    for attr, fn in vars(python_module or object()).items():
        if callable(fn) and getattr(fn, "__name__", None) == name:
            try:
                takes = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                continue
            if all(p in takes for p in params):
                found.append((python_module.__name__, attr))
    return found
