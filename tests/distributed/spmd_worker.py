"""One rank of the one-schedule tests (tests/distributed/test_one_schedule.py): every rank loads
the checkpoint with transformers' tensor parallelism, patches it and makes the same calls (SPMD);
rank 0 schedules, the others run its forwards. Writes what each call returned or raised to
``<out>/rank<RANK>.json``. Run as ``python spmd_worker.py JOB_JSON OUT_DIR`` with the variables
torchrun sets."""

import torch
from rank_main import dataset_runs, main, outcome


def run(job: dict, rank: int) -> dict:
    from transformers import AutoModelForCausalLM, DistributedConfig

    import paged_hf

    model = AutoModelForCausalLM.from_pretrained(
        job["path"], distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
    )
    paged_hf.patch(model)
    ids, mask = torch.tensor(job["input_ids"]), torch.tensor(job["attention_mask"])
    new = job["max_new_tokens"]

    def generate(new_tokens=new, **kw):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **kw)[
            :, ids.shape[1] :
        ].tolist()

    engine = paged_hf.engine_for(model)
    out = {"greedy": outcome(lambda: generate(do_sample=False))}
    hits = engine.stats()["prefix_hit_tokens"]
    out["again"] = outcome(lambda: generate(do_sample=False))
    out["hits_again"] = engine.stats()["prefix_hit_tokens"] - hits
    # speculation: the leader's drafts reach the followers' forwards with the step's tokens
    # (the leader's step costs pinned where drafts pay: whether they pay is timing, not this test)
    proposed = engine.stats()["draft_tokens_proposed"]
    fit = engine.scheduler.step_time
    timed = fit.coef, fit.observe
    fit.coef, fit.observe = (0.02, 0.0, 1e-6), lambda *args: None
    out["lookup"] = outcome(lambda: generate(do_sample=False, prompt_lookup_num_tokens=3))
    fit.coef, fit.observe = timed
    out["lookup_proposed"] = engine.stats()["draft_tokens_proposed"] - proposed
    # sampling: rank 0 samples, every rank returns its tokens (each rank seeds its own generator)
    torch.manual_seed(1000 + rank)
    out["sampled"] = outcome(lambda: generate(do_sample=True, top_k=0, temperature=1.0))
    # the same seed again, its prompts now cached: the same samples (issue 72)
    torch.manual_seed(1000 + rank)
    out["sampled_again"] = outcome(lambda: generate(do_sample=True, top_k=0, temperature=1.0))
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    params = paged_hf.SamplingParams(max_new_tokens=new)
    out["engine_generate"] = outcome(
        lambda: [o.token_ids for o in engine.generate(prompts, params)]
    )
    pairs = [(p[:3], p[3:]) for p in prompts]
    out["score"] = outcome(lambda: [round(s.logprob, 4) for s in engine.score(pairs)])
    # arguments that differ between ranks: every rank raises, naming the rank
    out["differ"] = outcome(lambda: generate(new + rank, do_sample=False))
    # a bad request on every rank: the leader's error on every rank, and the engine goes on
    bad = [[model.config.vocab_size + 5]]
    out["bad"] = outcome(lambda: [o.error for o in engine.generate(bad, params)])
    out["after_bad"] = outcome(lambda: generate(do_sample=False))
    # recompute preemption: an engine with a pool too small for every row at once
    small = paged_hf.Engine(model, num_blocks=job["small_pool"], max_num_seqs=len(prompts))
    out["preempted"] = outcome(lambda: [o.token_ids for o in small.generate(prompts, params)])
    out["preemptions"] = small.stats()["preemptions"]
    out |= copy_on_write_runs(model, prompts, new)
    out |= dataset_runs(model, job, ("generation", "generation_num_tokens"))
    out["steps"] = engine.stats()["steps"]
    out["tp_stats"] = engine.stats()["tensor_parallel"]
    out["blocks_used"] = engine.stats()["blocks_used"] + small.stats()["blocks_used"]
    return out


def copy_on_write_runs(model, prompts: list[list[int]], new: int) -> dict:
    """Seeded n=3 sampling and a beam search on an engine of 4-token blocks: each prompt's partly
    filled last block is shared by its samples (beams) and copied on their first write, so the
    leader's step sends the followers block copies to apply. Also how many block copies this
    rank's runner applied."""
    import paged_hf

    engine = paged_hf.Engine(model, block_size=4)
    copies = []
    execute = engine.runner.execute

    def counting(scheduled, block_copies):
        copies.extend(block_copies)
        return execute(scheduled, block_copies)

    engine.runner.execute = counting  # the leader's steps and the followers' forwards alike
    params = paged_hf.SamplingParams(
        max_new_tokens=new, n=3, seed=7, temperature=1.0, ignore_eos=True
    )
    return {
        "cow_sampled": outcome(
            lambda: [[c.token_ids for c in o.completions] for o in engine.generate(prompts, params)]
        ),
        "cow_beams": outcome(lambda: engine.beam_search(prompts, num_beams=3, max_new_tokens=new)),
        "cow_copies": len(copies),
    }


if __name__ == "__main__":
    main(run)
