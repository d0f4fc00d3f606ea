"""One request's state, the bottom layer (map: docs/architecture.md)."""
