"""Adapters for other tools, each importing its tool only when imported."""
