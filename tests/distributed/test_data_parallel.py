"""Data parallel (issue 57): transformers' ``DistributedConfig(dp_replicate_size=2, tp_size=2)``
on four CPU processes (two copies of a tiny llama, each over two tensor-parallel ranks) and
``fsdp_size=2`` on two (FSDP2 alone). FSDP gathers each module's weights before its forward;
``patch`` gathers them once and keeps them (paged_hf/model/tensor_parallel.py), so each copy runs
its own requests. Each copy's ``model.generate`` gives transformers' tokens on the unsharded
model (fp32); ``generate_dataset`` gives rank 0 the one-process result in row order, from its
checkpoint too, and every other rank its copy's shard; after ``unpatch`` FSDP reshards again."""

from pathlib import Path

import pytest
from datasets import Dataset
from spmd_launch import launch
from tiny_models import left_pad, make_tiny_model, tiny_prompts
from tiny_tokenizer import make_tiny_tokenizer

import paged_hf

NEW_TOKENS = 6
TEXTS = ["the cat sat", "a long row of words to read", "x", "so it goes", "one two three four"]
WORKER = Path(__file__).with_name("dp_worker.py")
LAYOUTS = {  # name: (DistributedConfig, processes)
    "dp2_tp2": ({"dp_replicate_size": 2, "tp_size": 2}, 4),
    "fsdp2": ({"fsdp_size": 2}, 2),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, tmp_path_factory):
    """(each copy's oracle tokens, the one-process dataset, each rank's results)."""
    config, world = LAYOUTS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model("llama")
    model.save_pretrained(tmp / "llama")
    copies = world // config.get("tp_size", 1)
    batches = [
        left_pad(tiny_prompts(model.config.vocab_size, 2, (4 + 5 * c, 9), seed=c))
        for c in range(copies)
    ]
    oracle = [
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)[
            :, ids.shape[1] :
        ].tolist()
        for ids, mask in batches
    ]
    alone = paged_hf.generate_dataset(
        paged_hf.patch(model),
        make_tiny_tokenizer(),
        Dataset.from_dict({"prompt": TEXTS}),
        sampling_params=paged_hf.SamplingParams(max_new_tokens=NEW_TOKENS),
        progress=False,
    )
    job = {
        "path": str(tmp / "llama"),
        "config": config,
        "input_ids": [ids.tolist() for ids, _ in batches],
        "attention_mask": [mask.tolist() for _, mask in batches],
        "max_new_tokens": NEW_TOKENS,
        "texts": TEXTS,
        "checkpoint_dir": str(tmp / "checkpoint"),
    }
    results = launch(WORKER, job, tmp, world=world)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    files = sorted(p.name for p in (tmp / "checkpoint").glob("results-*.jsonl"))
    assert files == [f"results-{c}.jsonl" for c in range(copies)], "one results file a copy"
    return oracle, [TEXTS, list(alone["generation"])], results


def test_each_copy_generates_its_own_prompts_as_transformers_does(run):
    oracle, _, results = run
    for rank, r in enumerate(results):
        assert r["greedy"] == {"value": oracle[r["copy"]]}, f"rank {rank}"


@pytest.mark.parametrize("call", ["dataset", "dataset_resumed"])
def test_rank_zero_gets_the_one_process_dataset_and_the_others_their_shard(run, call):
    _, alone, results = run
    assert results[0][call] == {"value": alone}
    for rank, r in enumerate(results[1:], start=1):
        prompts, generations = r[call]["value"]
        assert prompts and len(prompts) < len(TEXTS), f"rank {rank}: its copy's shard"
        for prompt, text in zip(prompts, generations):
            assert text == alone[1][TEXTS.index(prompt)], f"rank {rank}: {prompt!r}"


def test_after_unpatch_fsdp_runs_transformers_generate_again(run):
    oracle, _, results = run
    for rank, r in enumerate(results):
        assert r["unpatched"] == {"value": oracle[r["copy"]]}, f"rank {rank}"
