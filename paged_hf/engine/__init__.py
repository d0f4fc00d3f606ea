"""The engine: requests in, tokens out (map: docs/architecture.md)."""

from .engine import Engine

__all__ = ["Engine"]
