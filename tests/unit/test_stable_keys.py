"""The weights fingerprint that seeds the tiers' keys: equal for the same weights in any process,
different for any change of a weight's bytes, anywhere in any tensor, or of its name, dtype or shape."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from tiny_models import make_tiny_model

from paged_hf.cache.stable_keys import hash_tensor, weights_fingerprint


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def test_the_same_weights_built_twice_have_one_fingerprint(model):
    assert weights_fingerprint(model) == weights_fingerprint(make_tiny_model("llama"))


def _changed(model, edit):
    other = copy.deepcopy(model)
    with torch.no_grad():
        edit(other)
    return weights_fingerprint(other)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.model.layers[1].self_attn.k_proj.weight[-1, -1].add_(1e-3),  # its last element
        lambda m: m.model.layers[0].mlp.down_proj.weight[7, 20].mul_(-1),
        lambda m: m.model.norm.weight[-1].add_(1.0),
        lambda m: m.model.rotary_emb.inv_freq[-1].mul_(2.0),  # a buffer
        lambda m: m.half(),  # the same values in another dtype
    ],
    ids=["last element of a k_proj", "one mlp element", "norm", "a buffer", "dtype"],
)
def test_any_change_of_any_tensor_changes_it(model, edit):
    assert _changed(model, edit) != weights_fingerprint(model)


def test_a_renamed_tensor_changes_it(model):
    other = copy.deepcopy(model)
    other.model.layers[0].self_attn.register_buffer("extra", torch.zeros(3))
    renamed = copy.deepcopy(model)
    renamed.model.layers[0].self_attn.register_buffer("other", torch.zeros(3))
    assert weights_fingerprint(other) != weights_fingerprint(renamed)


def test_hashing_leaves_the_weights_storage_resizable_and_hashes_every_byte(model, monkeypatch):
    """numpy's view of a tensor marks its storage never to be resized, which broke FSDP's
    resharding at unpatch (tests/distributed/test_data_parallel.py); chunks hash as the whole."""
    weights_fingerprint(model)
    assert all(p.untyped_storage().resizable() for p in model.parameters())
    t = torch.randn(1000)
    whole = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    monkeypatch.setattr("paged_hf.cache.stable_keys._CHUNK", 7)  # chunks that split elements
    h = hashlib.sha256()
    hash_tensor(h, t)
    assert h.hexdigest() == whole
