"""One rank of a tensor-parallel run (tests/distributed/test_tensor_parallel.py): loads each job's
checkpoint with transformers' ``tp_plan="auto"``, patches it, generates greedily, and writes what it
saw to ``<out>/rank<RANK>.json``. Run as ``python tp_worker.py JOBS_JSON OUT_DIR`` with the variables
torchrun sets (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)."""

import traceback

import torch
from rank_main import main


def run_job(job: dict) -> dict:
    from transformers import AutoModelForCausalLM, DistributedConfig

    import paged_hf

    # tp_plan="auto" as a from_pretrained keyword is the deprecated spelling of the same
    config = DistributedConfig(tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(
        job["path"], distributed_config=config, dtype=torch.float32
    )
    paged_hf.patch(model)
    engine = paged_hf.engine_for(model)
    schedule = []
    original = engine.scheduler.schedule

    def logged():
        out = original()
        schedule.append([(r.request_id, n) for r, n in out.scheduled])
        return out

    engine.scheduler.schedule = logged
    ids, mask = torch.tensor(job["input_ids"]), torch.tensor(job["attention_mask"])
    kwargs = dict(attention_mask=mask, max_new_tokens=job["max_new_tokens"], do_sample=False)
    tokens = model.generate(ids, **kwargs)[:, ids.shape[1] :].tolist()
    # the same call again: served from the prefix cache, so the weights watch must not have seen a
    # change that is not there
    hits = engine.stats()["prefix_hit_tokens"]
    again = model.generate(ids, **kwargs)[:, ids.shape[1] :].tolist()
    hits_again = engine.stats()["prefix_hit_tokens"] - hits
    unchanged = not engine.check_weights(rescan=True)
    # a write through a DTensor weight is seen (on the rank that made it: here every rank)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.0)
    written = engine.check_weights()
    return {
        **stand_aside(model),
        "tokens": tokens,
        "again": again,
        "hits_again": hits_again,
        "unchanged": unchanged,
        "written": written,
        "layers": [[s.q_heads, s.kv_heads, s.k_dim] for s in engine.layout.layers],
        "num_blocks": engine.kv_manager.pool.num_blocks,
        "page_bytes": engine.page_bytes,
        "packed": 0 if engine.runner.packed is None else len(engine.runner.packed.modules),
        "schedule": schedule,
    }


def stand_aside(model) -> dict:
    """What does not serve a tensor-parallel model yet, and says so."""
    import paged_hf
    from paged_hf.cache.stable_keys import weights_fingerprint
    from paged_hf.execution.cpu.batch_invariance import refusal

    try:
        weights_fingerprint(model)
        fingerprint = None
    except ValueError as e:
        fingerprint = str(e)
    tiers = paged_hf.Engine(model, kv_host_cache_bytes=1 << 20).scheduler.kv_tiers
    return {
        "fingerprint_refused": fingerprint,
        "tiers": tiers is not None,
        "batch_invariance_refused": refusal(
            model, torch.bfloat16, torch.device("cpu"), False, None, True
        ),
    }


def run_jobs(jobs: list[dict], rank: int) -> dict:
    """Each job's results by family, until one fails (the ranks no longer keep step then)."""
    results = {}
    for job in jobs:
        try:
            results[job["family"]] = run_job(job)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[job["family"]] = {"error": traceback.format_exc()}
            break
    return results


if __name__ == "__main__":
    main(run_jobs)
