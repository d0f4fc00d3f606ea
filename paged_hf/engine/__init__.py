"""The engine: requests in, tokens out (map: docs/architecture.md)."""

from .core import EngineCore

__all__ = ["EngineCore"]
