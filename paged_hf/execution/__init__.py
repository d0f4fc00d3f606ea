"""Execution: KV tensors, step metadata, attention, the forward, sampling."""
