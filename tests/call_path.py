"""What a patched ``model.generate`` call passes through in paged_hf around its engine steps:
every file, class and function of the package it enters from the call's start to its first
``step``, and after its last (the step's own internals excluded; docs/architecture.md quotes it).

    python tests/call_path.py          # counts, then each function in the order first entered
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_models import make_tiny_model  # noqa: E402

import paged_hf  # noqa: E402

ROOT = os.path.dirname(paged_hf.__file__)
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<lambda>", "<dictcomp>", "<setcomp>")


def is_step(code) -> bool:
    return code.co_name == "step" and code.co_filename.endswith("step.py")


def call_path(model, **call) -> tuple[set[str], set[str], set[str], list[str]]:
    """(files, classes whose code runs, types of the objects it runs on, functions in first-entered
    order) of one ``model.generate(**call)``. A mixin is a class of its own; its object's type is
    the one object a reader meets."""
    files, classes, objects, functions, in_step = set(), set(), set(), [], [0]

    def profile(frame, event, _arg):
        code = frame.f_code
        if not code.co_filename.startswith(ROOT):
            return
        if event == "return" and in_step[0] and is_step(code):
            in_step[0] -= 1
        if event != "call":
            return
        if is_step(code):
            in_step[0] += 1
            functions.append("step")
        if in_step[0]:
            return
        rel = os.path.relpath(code.co_filename, ROOT)
        files.add(rel)
        parts = code.co_qualname.split(".")
        if len(parts) > 1 and parts[1] != "<locals>":
            classes.add(parts[0])
            me = frame.f_locals.get("self", frame.f_locals.get("cls"))
            if me is not None:
                objects.add(me.__name__ if isinstance(me, type) else type(me).__name__)
        if code.co_name not in COMPREHENSIONS:
            functions.append(f"{rel}:{code.co_qualname}")

    sys.setprofile(profile)
    try:
        model.generate(**call)
    finally:
        sys.setprofile(None)
    return files, classes, objects, list(dict.fromkeys(functions))


def main() -> None:
    model = make_tiny_model("llama")
    paged_hf.patch(model)
    call = {
        "input_ids": torch.tensor([[1, 5, 7, 9], [0, 3, 4, 6]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]),
        "max_new_tokens": 3,
        "do_sample": False,
    }
    model.generate(**call)  # the engine built, the first call's one-off work done
    files, classes, objects, functions = call_path(model, **call)
    counts = {
        k: len(v) for k, v in [("files", files), ("classes", classes), ("object types", objects)]
    }
    lists = {"file_list": sorted(files), "class_list": sorted(classes), "objects": sorted(objects)}
    print(json.dumps(counts | {"functions": len(functions)} | lists, indent=1))
    print("\n".join(functions))


if __name__ == "__main__":
    main()
