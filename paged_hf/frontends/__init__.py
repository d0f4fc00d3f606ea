"""Front ends: the ways in besides ``model.generate`` (map: docs/architecture.md)."""
