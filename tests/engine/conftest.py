"""Fixtures the fault-isolation and configuration tests share (a module that defines its own
``model`` or ``prompts`` uses that one)."""

import pytest
from tiny_models import make_tiny_model, tiny_prompts


@pytest.fixture(scope="module")
def model():
    """fp64: greedy tokens then do not depend on what else shares the batch."""
    return make_tiny_model("llama").double()


@pytest.fixture(scope="module")
def prompts(model):
    return tiny_prompts(model.config.vocab_size, 4, [5, 9, 13, 7], seed=3)
