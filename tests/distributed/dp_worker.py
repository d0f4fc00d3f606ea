"""One rank of the data-parallel tests (tests/distributed/test_data_parallel.py): every rank loads
the checkpoint with transformers' ``DistributedConfig`` (data parallel: FSDP2, with or without
tensor parallelism inside each copy), patches it, generates its copy's own prompts and runs
``generate_dataset`` twice (rank_main.dataset_runs: the second from its checkpoint), then unpatches and runs transformers'
own ``generate`` on the model FSDP shards again. Writes ``<out>/rank<RANK>.json``."""

import torch
from rank_main import dataset_runs, main, outcome


def run(job: dict, rank: int) -> dict:
    from transformers import AutoModelForCausalLM, DistributedConfig

    import paged_hf

    model = AutoModelForCausalLM.from_pretrained(
        job["path"], distributed_config=DistributedConfig(**job["config"]), dtype=torch.float32
    )
    copy = rank // job["config"].get("tp_size", 1)
    ids, mask = (torch.tensor(job[k][copy]) for k in ("input_ids", "attention_mask"))

    def generate() -> list:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=job["max_new_tokens"], do_sample=False
        )
        return out[:, ids.shape[1] :].tolist()

    paged_hf.patch(model)
    out = {"copy": copy, "greedy": outcome(generate)}
    out |= dataset_runs(model, job, ("prompt", "generation"))
    paged_hf.unpatch(model)  # FSDP reshards the weights after each forward again
    out["unpatched"] = outcome(generate)
    return out


if __name__ == "__main__":
    main(run)
