"""The cache: physical KV blocks and what may reuse them (map: docs/architecture.md)."""
