"""Decoding sequences attend in groups of similar length (paged_hf/execution/backends/torch_backend.py):
the grouping itself, and generation through several groups against transformers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_teacher_forced
from tiny_models import FAMILIES, make_tiny_model, tiny_prompts

import paged_hf
import paged_hf.execution.backends.torch_backend as torch_backend
from paged_hf.execution.backends.torch_backend import decode_groups


def _padded(lengths: list[int], groups: list[list[int]], bs: int) -> int:
    """KV tokens the groups gather: each member padded to its group's longest, in whole blocks."""
    return sum(len(g) * -(-max(lengths[i] for i in g) // bs) * bs for g in groups)


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=80),
    bs=st.sampled_from([1, 4, 16]),
    padding=st.sampled_from([0, 64, 512, 4096]),
)
def test_groups_partition_by_length_and_bound_the_padding(lengths, bs, padding):
    groups = decode_groups(lengths, bs, padding)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    blocks = [-(-n // bs) for n in lengths]
    for g in groups:  # contiguous, ascending length ranges
        assert [blocks[i] for i in g] == sorted(blocks[i] for i in g)
    for a, b in zip(groups, groups[1:]):
        assert max(blocks[i] for i in a) < min(blocks[i] for i in b)
        # a split happens only where taking the next sequence would have cost more than `padding`
        assert len(a) * (blocks[b[0]] - blocks[a[-1]]) * bs > padding
    assert _padded(lengths, groups, bs) <= _padded(lengths, [list(range(len(lengths)))], bs)
    assert len(decode_groups(lengths, bs, 1 << 60)) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_through_several_decode_groups_agrees_with_transformers(family, monkeypatch):
    """Every distinct length its own group (padding 0): greedy tokens are still transformers'
    argmax, for every family (sliding windows and softcaps included)."""
    seen: list[list[list[int]]] = []

    def spy(lengths, block_size, padding_tokens=None):
        groups = decode_groups(lengths, block_size, 0)
        seen.append(groups)
        return groups

    monkeypatch.setattr(torch_backend, "decode_groups", spy)
    reference = make_tiny_model(family)
    model = make_tiny_model(family)
    # pairs of equal block counts (14/13, 6/5, 27/26 in 4-token blocks), the longer one first in
    # the batch: a group's members are not in batch order
    lengths = [14, 2, 13, 6, 27, 5, 41, 26]
    prompts = tiny_prompts(reference.config.vocab_size, len(lengths), lengths, seed=5)
    # the reference path groups its decodes
    engine = paged_hf.Engine(
        model,
        num_blocks=128,
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        backend="torch",
    )
    outs = engine.generate(prompts, paged_hf.SamplingParams(max_new_tokens=10))
    assert max(len(groups) for groups in seen) >= 4, "the decodes really ran in several groups"
    assert any(g != sorted(g) for groups in seen for g in groups), (
        "some group's members are out of batch order"
    )
    for prompt, out in zip(prompts, outs):
        assert_teacher_forced(reference, prompt, out.token_ids, what=f"{family}/grouped decodes")
