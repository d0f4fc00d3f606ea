"""One rank of the entry-point tests (tests/distributed/test_entry_points.py): ``paged-hf generate
--tp-size 2`` and lm-eval's ``--model paged_hf`` with ``tp_size=2``, on every rank as torchrun runs
them. Writes each rank's exit code and lm-eval metrics to ``<out>/rank<RANK>.json``."""

import sys
from pathlib import Path

from rank_main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # eval_tasks


def run(job: dict, rank: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import paged_hf.integrations.lm_eval  # noqa: F401 - registers --model paged_hf
    import paged_hf.integrations.lm_eval_engine as eval_engine
    import paged_hf.model.loading as loading
    from paged_hf.frontends import cli

    loaded = []  # each loaded model's tensor-parallel degree: what the options asked for

    def recording(load):
        def wrapped(*args, **kwargs):
            model, tokenizer = load(*args, **kwargs)
            loaded.append(getattr(model, "_tp_size", None))
            return model, tokenizer

        return wrapped

    loading.load_model = recording(loading.load_model)
    eval_engine.load_model = recording(eval_engine.load_model)
    out = {"cli": cli.main(job["cli"] + ["--tp-size", "2"])}
    result = lm_eval.simple_evaluate(
        model="paged_hf",
        model_args=job["model_args"] + ",tp_size=2",
        tasks=job["tasks"],
        task_manager=TaskManager(include_path=job["tasks_dir"], include_defaults=False),
        device="cpu",
        batch_size=4,
    )
    out["lm_eval"] = None if result is None else result["results"]
    out["loaded_tp"] = loaded
    return out


if __name__ == "__main__":
    main(run)
