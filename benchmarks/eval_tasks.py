"""Local lm-evaluation-harness tasks, written to a directory: no hub access needed.

    phf_mc       multiple choice: N questions x 4 choices, ~80-token contexts (a short story with
                 numbers, then a question; the choices are numbers), metrics acc / acc_norm
    phf_gen      generate_until: N few-shot one-digit arithmetic prompts, the same 5 shots for
                 every prompt (lm-eval's first_n sampler, as MMLU's and BBH's configs use), until
                 ["\\n\\n", "Q:"], metric exact_match (leading whitespace removed)
    phf_rolling  loglikelihood_rolling: N short stories, word/byte perplexity, bits per byte
    phf_gen_shots  generate_until: N story questions, 5 shots per prompt drawn by lm-eval's default
                 (seeded, per document) sampler from 50 solved stories: ~500-token prompts that
                 share little with each other but are the same in every run (the disk tier's case)

    write_tasks("tasks/", n_mc=200, n_gen=100)   # then: lm-eval --include_path tasks/ --tasks phf_mc,phf_gen

Used by benchmarks/bench_eval.py, tests/integrations/test_lm_eval.py and examples/lm_eval_local.py. The data
are drawn from a seeded generator, so a directory is the same on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_NAMES = "Tom Anna Ravi Mei Lucas Sofia Omar Ines Kenji Zara Noah Lena".split()
_THINGS = "apples marbles books stamps pencils shells coins cards plums buttons".split()
_PLACES = "the market|school|the library|the beach|a garden|the station|a museum|the park"
_PLACES = _PLACES.split("|")
_FILLER = [
    "The weather was mild and a light wind came from the sea.",
    "Nobody was in a hurry, and the streets were quiet for a Tuesday.",
    "It had rained the night before, so the paths were still wet.",
    "A small dog followed them for a while and then ran off.",
    "They talked about the week ahead and what they would cook.",
    "The sun was low by the time they reached the corner.",
]


def _story(rng: random.Random) -> tuple[str, str, int]:
    """(passage, question, answer) about counting things."""
    name, friend = rng.sample(_NAMES, 2)
    thing = rng.choice(_THINGS)
    start, got, gave = rng.randint(3, 40), rng.randint(2, 30), rng.randint(1, 9)
    place = rng.choice(_PLACES)
    passage = (
        f"{name} went to {place} with {friend} in the morning. {rng.choice(_FILLER)} {name} had {start} "
        f"{thing} at the start of the day. At {place}, {name} found {got} more {thing} and gave {gave} "
        f"of them to {friend}."
    )
    return passage, f"How many {thing} did {name} have at the end of the day?", start + got - gave


def _choices(rng: random.Random, answer: int) -> tuple[list[str], int]:
    wrong = set()
    while len(wrong) < 3:
        w = answer + rng.choice([-10, -3, -2, -1, 1, 2, 3, 5, 10])
        if w > 0 and w != answer:
            wrong.add(w)
    options = sorted(wrong | {answer})
    rng.shuffle(options)
    return [str(o) for o in options], options.index(answer)


def _metrics(*metrics: str) -> str:
    """YAML's metric list: "name aggregation higher_is_better" each."""
    items = (m.split() for m in metrics)
    listed = "".join(
        f"  - metric: {m}\n    aggregation: {a}\n    higher_is_better: {h}\n" for m, a, h in items
    )
    return f"metric_list:\n{listed}"


# the generation tasks' scoring: leading whitespace stripped, the first line, exact match
_EXACT_MATCH_AFTER_STRIPPING = f"""filter_list:
  - name: "strip"
    filter:
      - function: "remove_whitespace"
      - function: "take_first"
{_metrics("exact_match mean true")}    ignore_case: true
    ignore_punctuation: true
"""


def _task(out: Path, name: str, splits: dict[str, tuple[str, list[dict]]], body: str) -> None:
    """Each split's rows as JSON lines in ``out``, and the task's YAML: its data files, ``body``."""
    files = ""
    for split, (file, rows) in splits.items():
        _jsonl(out / file, rows)
        files += f"\n    {split}: {(out / file).resolve()}"
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:{files}\n"
    (out / f"{name}.yaml").write_text(f"{head}{body}metadata:\n  version: 1.0\n")


def write_tasks(
    directory: str | Path, n_mc: int = 200, n_gen: int = 100, n_rolling: int = 20, seed: int = 0
) -> Path:
    """Write the tasks' data and YAML configs into ``directory``; returns it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    mc = []
    for _ in range(n_mc):
        passage, question, answer = _story(rng)
        choices, label = _choices(rng, answer)
        context = f"{passage}\nQuestion: {question}\nAnswer:"
        mc.append({"context": context, "choices": choices, "label": label})
    body = f"""output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
{_metrics("acc mean true", "acc_norm mean true")}"""
    _task(out, "phf_mc", {"test": ("mc.jsonl", mc)}, body)

    def arithmetic() -> dict:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        op = rng.choice(["plus", "times"])
        answer = a + b if op == "plus" else a * b
        return {"question": f"What is {a} {op} {b}?", "answer": str(answer)}

    gen = [arithmetic() for _ in range(20 + n_gen)]  # 20 to draw shots from, then the questions
    splits = {"train": ("gen_train.jsonl", gen[:20]), "test": ("gen_test.jsonl", gen[20:])}
    body = f"""output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 5
fewshot_config:
  sampler: first_n
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until:
    - "\\n\\n"
    - "Q:"
  do_sample: false
  max_gen_toks: 16
{_EXACT_MATCH_AFTER_STRIPPING}"""
    _task(out, "phf_gen", splits, body)

    stories = []
    for _ in range(n_rolling):
        parts = [_story(rng) for _ in range(rng.randint(1, 3))]
        stories.append({"text": " ".join(f"{p} {q} The answer is {a}." for p, q, a in parts)})
    perplexity = ("word_perplexity", "byte_perplexity")
    metrics = [f"{m} weighted_perplexity false" for m in perplexity]
    metrics.append("bits_per_byte " * 2 + "false")
    body = f"""output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
{_metrics(*metrics)}"""
    _task(out, "phf_rolling", {"test": ("rolling.jsonl", stories)}, body)
    _write_gen_shots(out, rng, n_gen)  # last: the other tasks' data stay as they were
    return out


def _write_gen_shots(out: Path, rng: random.Random, n: int) -> None:
    def solved() -> dict:
        passage, question, answer = _story(rng)
        return {"context": f"{passage}\nQuestion: {question}", "answer": str(answer)}

    stories = [solved() for _ in range(50 + n)]  # 50 to draw shots from, then the questions
    splits = {"train": ("shots_train.jsonl", stories[:50])}
    splits["test"] = ("shots_test.jsonl", stories[50:])
    body = f"""output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 5
doc_to_text: "{{{{context}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until:
    - "\\n"
  do_sample: false
  max_gen_toks: 8
{_EXACT_MATCH_AFTER_STRIPPING}"""
    _task(out, "phf_gen_shots", splits, body)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    import sys

    print(write_tasks(sys.argv[1] if len(sys.argv) > 1 else "eval_tasks"))
