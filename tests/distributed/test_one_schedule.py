"""Tensor parallelism's one schedule (issue 57): two CPU processes hold a tiny llama's (GQA) or a
tiny qwen3_moe's heads (transformers' ``tp_plan="auto"``, gloo); every rank makes the same calls
and rank 0 alone schedules and samples, the other running its forwards
(paged_hf/engine/ranks.py). Every rank returns the unsharded model's tokens under transformers'
own ``generate`` (fp32), the same samples, scores and errors, and one process's seeded samples
and beams where blocks are copied on write; arguments that differ between ranks fail on every
rank, naming the rank."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from spmd_launch import launch
from spmd_worker import copy_on_write_runs
from tiny_models import EOS_ID, left_pad, make_arch_model, make_tiny_model, tiny_prompts
from tiny_tokenizer import make_tiny_tokenizer

import paged_hf

NEW_TOKENS = 8
TEXTS = ["the cat sat", "a long row of words to read", "x", "so it goes", "one two three four"]
WORKER = Path(__file__).with_name("spmd_worker.py")


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def ranks(request, tmp_path_factory):
    """(oracle tokens, each rank's results): the oracle is transformers' greedy ``generate`` on
    the unsharded checkpoint the ranks load."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model = make_tiny_model(family) if family == "llama" else make_arch_model(family)
    model.save_pretrained(tmp / family)
    ids, mask = left_pad(tiny_prompts(model.config.vocab_size, 3, (5, 19, 12)))
    oracle = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    job = {
        "path": str(tmp / family),
        "input_ids": ids.tolist(),
        "attention_mask": mask.tolist(),
        "max_new_tokens": NEW_TOKENS,
        "small_pool": 4,  # 3 rows of up to 27 tokens in 4 blocks of 16: llama preempts one
        "texts": TEXTS,
        "checkpoint_dir": str(tmp / "checkpoint"),
    }
    # generate_dataset in one process on the unsharded model: what every rank's run must give
    params = paged_hf.SamplingParams(max_new_tokens=NEW_TOKENS)
    rows = Dataset.from_dict({"prompt": TEXTS})
    alone = paged_hf.generate_dataset(
        paged_hf.patch(model), make_tiny_tokenizer(), rows, sampling_params=params, progress=False
    )
    # seeded n=3 sampling and beams on 4-token blocks in one process: the ranks' copy-on-write
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    cow_alone = json.loads(json.dumps(copy_on_write_runs(model, prompts, NEW_TOKENS)))
    # the leader's sampled call in one process: its seed (spmd_worker.py) keys the same streams
    torch.manual_seed(1000)
    sampled = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        top_k=0,
        temperature=1.0,
    )[:, ids.shape[1] :].tolist()
    results = launch(WORKER, job, tmp)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        r["alone"] = [list(alone["generation"]), [int(n) for n in alone["generation_num_tokens"]]]
        r["cow_alone"] = cow_alone
        r["sampled_alone"] = sampled
    return oracle[:, ids.shape[1] :].tolist(), results


def through_eos(rows: list[list[int]]) -> list[list[int]]:
    """transformers' padded rows as Engine.generate returns them: each up to its EOS."""
    return [row[: row.index(EOS_ID) + 1] if EOS_ID in row else row for row in rows]


@pytest.mark.parametrize("call", ["greedy", "again", "after_bad", "lookup"])
def test_every_rank_generates_the_unsharded_tokens(ranks, call):
    oracle, results = ranks
    for rank, r in enumerate(results):
        assert r[call] == {"value": oracle}, f"rank {rank}"


@pytest.mark.parametrize("call", ["engine_generate", "preempted"])
def test_every_rank_returns_the_engine_calls_unsharded_tokens(ranks, call):
    oracle, results = ranks
    for rank, r in enumerate(results):
        assert r[call] == {"value": through_eos(oracle)}, f"rank {rank}"


def test_rank_zero_schedules_and_the_others_follow(ranks, request):
    """The leader stepped and served the second call from its prefix cache; the follower ran no
    step of its own and holds no block. In the small pool llama's rows preempt one another
    (qwen3_moe's reach EOS before they would)."""
    _, (leader, follower) = ranks
    assert leader["steps"] > 0 and follower["steps"] == 0
    assert leader["hits_again"] > 0
    assert leader["lookup_proposed"] > 0  # the prompt-lookup call speculated
    if "llama" in request.node.callspec.id:
        assert leader["preemptions"] > 0
    assert leader["blocks_used"] == follower["blocks_used"] == 0
    # stats() say where each rank stands, that each holds half the KV heads, and the messages
    for rank, r in enumerate((leader, follower)):
        tp = r["tp_stats"]
        assert (tp["rank"], tp["ranks"], tp["copy"], tp["copies"]) == (rank, 2, 0, 1)
        assert tp["kv_heads"] >= 1 and not tp["whole_kv_on_every_rank"]
    assert leader["tp_stats"]["step_messages"] == leader["steps"]
    assert follower["tp_stats"]["step_messages"] == 0


@pytest.mark.parametrize("call", ["sampled", "score", "bad"])
def test_samples_scores_and_errors_are_the_same_on_every_rank(ranks, call):
    """Seeded differently, the ranks still return one sample (the leader's); scores and a bad
    request's error are the leader's too."""
    _, (leader, follower) = ranks
    assert "value" in leader[call] and leader[call] == follower[call]


def test_seeded_samples_are_one_process_s_and_the_same_again(ranks):
    """Under the same torch.manual_seed, the leader's sampled call gives what one process gives
    (the rows' streams are keyed when the call starts, on rank 0) and, its prompts cached, the same
    samples again (issue 72)."""
    _, results = ranks
    for rank, r in enumerate(results):
        assert r["sampled"]["value"] == r["sampled_alone"], f"rank {rank}"
        assert r["sampled_again"] == r["sampled"], f"rank {rank}"


def test_arguments_that_differ_fail_on_every_rank_naming_the_rank(ranks):
    _, results = ranks
    for r in results:
        assert "rank(s) [1] than on rank 0" in r["differ"]["raised"]


def test_blocks_copied_on_write_are_copied_on_every_rank(ranks):
    """Seeded n=3 sampling and a 3-beam search on 4-token blocks, where each prompt's partly
    filled last block is shared by its samples (beams) and copied on their first write: every
    rank returns what one process running the unsharded model returns (the same samples; the same
    beams, their scores to 1e-4), and each rank's runner made as many block copies as the one
    process (a follower that skipped them would attend over pages never written: other samples)."""
    _, results = ranks
    for rank, r in enumerate(results):
        alone = r["cow_alone"]
        assert "value" in alone["cow_sampled"] and "value" in alone["cow_beams"], alone
        assert r["cow_sampled"] == alone["cow_sampled"], f"rank {rank}"
        assert "value" in r["cow_beams"], f"rank {rank}: {r['cow_beams']}"
        for got, want in zip(r["cow_beams"]["value"], alone["cow_beams"]["value"], strict=True):
            assert [t for t, _ in got] == [t for t, _ in want], f"rank {rank}"
            assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-4)
    copies = results[0]["cow_alone"]["cow_copies"]
    assert copies > 0 and [r["cow_copies"] for r in results] == [copies] * len(results)


def test_generate_dataset_on_every_rank_is_the_one_process_result(ranks):
    """Every rank calls generate_dataset alike: each returns the whole dataset as one process
    running the unsharded model gives it, in order; run again, every row comes back from the
    checkpoint the leader wrote."""
    _, results = ranks
    for rank, r in enumerate(results):
        assert r["dataset"] == {"value": r["alone"]}, f"rank {rank}"
        assert r["dataset_resumed"] == r["dataset"], f"rank {rank}"
