"""Tensor parallelism (issue 57): transformers shards a tiny model over two CPU processes (gloo,
``from_pretrained(..., tp_plan="auto")``), each rank patches its model and runs greedy
``model.generate`` on a padded batch, and every rank's tokens are the unsharded model's under
transformers' own ``generate`` (fp32: the same tokens exactly).

Both ranks run every family in one launch (tests/distributed/tp_worker.py): starting two processes
that import torch and transformers is most of the time. The tests also record that each rank's KV
holds its own heads, that rank 0 alone schedules, that the weights watch reads the shards, and what
stands aside.
"""

from pathlib import Path

import pytest
from spmd_launch import launch
from tiny_models import left_pad, make_config, make_tiny_model, tiny_prompts

WORLD = 2
FAMILIES = ("llama", "qwen3", "gemma2")  # GQA (4 q heads, 2 kv); q/k norms; windows and softcaps
LENGTHS = (5, 19, 12)  # across a 16-token block, and gemma2's 8-token window
NEW_TOKENS = 8
# the launch as a whole; a collective one rank never reaches fails sooner (tp_worker.py: 30 s)
TIMEOUT_S = 240
WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(oracle tokens, each rank's results) by family: the oracle is transformers' greedy
    ``generate`` on the unsharded model, the same checkpoint the ranks load."""
    tmp = tmp_path_factory.mktemp("tp")
    jobs, oracle = [], {}
    for family in FAMILIES:
        model = make_tiny_model(family)
        path = tmp / family
        model.save_pretrained(path)
        ids, mask = left_pad(tiny_prompts(model.config.vocab_size, len(LENGTHS), LENGTHS))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        oracle[family] = out[:, ids.shape[1] :].tolist()
        jobs.append(
            {
                "family": family,
                "path": str(path),
                "input_ids": ids.tolist(),
                "attention_mask": mask.tolist(),
                "max_new_tokens": NEW_TOKENS,
            }
        )
    ranks = launch(WORKER, jobs, tmp, WORLD, TIMEOUT_S)
    missing = {"error": "not run: an earlier family failed on this rank"}
    return {f: (oracle[f], [r.get(f, missing) for r in ranks]) for f in FAMILIES}


def _ranks(runs, family):
    oracle, ranks = runs[family]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return oracle, ranks


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_generates_the_unsharded_tokens(runs, family):
    oracle, ranks = _ranks(runs, family)
    for rank, r in enumerate(ranks):
        assert r["tokens"] == oracle, f"rank {rank}"
        assert r["again"] == oracle, f"rank {rank}, from the prefix cache"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_keeps_its_own_heads(runs, family):
    """The probe sees the heads transformers hands the attention function: the rank's own, so its KV
    pages are half the unsharded model's; both ranks size their pools alike; rank 0 alone
    schedules (paged_hf/engine/ranks.py)."""
    _, ranks = _ranks(runs, family)
    cfg = make_config(family)
    local = [cfg.num_attention_heads // WORLD, cfg.num_key_value_heads // WORLD, cfg.head_dim]
    for r in ranks:
        assert r["layers"] == [local] * cfg.num_hidden_layers
        assert r["packed"] == 0  # transformers' TP linears run their own forwards
    assert ranks[0]["num_blocks"] == ranks[1]["num_blocks"]
    assert ranks[0]["page_bytes"] == ranks[1]["page_bytes"]
    assert ranks[0]["schedule"] and ranks[1]["schedule"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_watch_reads_the_shards(runs, family):
    """Nothing changed: the second call is served from the leader's prefix cache; a write through
    a DTensor weight is seen on every rank."""
    _, ranks = _ranks(runs, family)
    assert ranks[0]["hits_again"] > 0
    for r in ranks:
        assert r["unchanged"] and r["written"]


@pytest.mark.parametrize("family", FAMILIES)
def test_what_reads_whole_weights_stands_aside(runs, family):
    """The tiers' weights fingerprint refuses a DTensor, so the tiers are off (with a warning);
    batch_invariant=True refuses by name."""
    _, ranks = _ranks(runs, family)
    for r in ranks:
        assert "is sharded across ranks" in r["fingerprint_refused"]
        assert not r["tiers"]
        assert "tensor-parallel" in r["batch_invariance_refused"]
