"""Which transformers causal LMs paged_hf runs: the support table, measured, not declared.

Design notes: docs/internals.md, paged_hf/model/support.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import re
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from . import oracle
from .oracle import LOGPROB_TOL, TOKEN_TOL
from .tiny_configs import MAX_PARAMS, build_tiny_model, tiny_config  # noqa: F401 - the tests and the sweep build through support

PROMPT_LENGTHS = (5, 23, 41, 70)
MAX_NEW_TOKENS = 12
TOP_LOGPROBS = 5
# stateful layers, against transformers' incremental path: see compare()
STATEFUL_LOGPROB_TOL = 5e-4
SETTINGS = {
    "defaults": {},
    "small blocks and budget": dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4),
}
# image-text models whose text path is checked too (their causal-LM entry, if any, is checked as well)
MULTIMODAL_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "mistral3",
    "gemma3",
    "paligemma",
)


# ---- one type ----------------------------------------------------------------------------------------
@dataclass
class Result:
    model_type: str
    verdict: str  # "pass", "refused", "wrong", "error", "no tiny model"
    reason: str = ""
    model_class: str = ""
    seconds: float = 0.0
    multimodal: bool = False

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prompt_ids(model: torch.nn.Module) -> list[list[int]]:
    from .capability import text_config

    vocab = text_config(model).vocab_size
    special = _special_ids(model)
    usable = [t for t in range(4, vocab) if t not in special]
    gen = torch.Generator().manual_seed(0)
    return [
        [usable[i] for i in torch.randint(len(usable), (n,), generator=gen).tolist()]
        for n in PROMPT_LENGTHS
    ]


def _special_ids(model: torch.nn.Module) -> set[int]:
    from .capability import text_config

    ids = set()
    for c in (model.config, text_config(model)):
        for k, v in c.to_dict().items():
            if k.endswith(("_token_id", "_token_index")):
                ids.update(
                    [v] if isinstance(v, int) else [x for x in (v or []) if isinstance(x, int)]
                )
    return ids


def compare(
    reference: torch.nn.Module, prompts: list[list[int]], outputs: list[Any], stateful: bool = False
) -> list[str]:
    """What differs from the reference, teacher-forced (empty when nothing does). ``stateful``: the
    logprobs answer to transformers' incremental path (``oracle.incremental_logits``), and chunk
    boundaries move fp32 rounding, so they are held to STATEFUL_LOGPROB_TOL."""
    problems = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if out.error:
            raise RuntimeError(out.error)
        gen = out.token_ids
        logits = oracle.reference_logits(reference, prompt, gen)
        found = [
            (
                step,
                0,
                f"prompt {i} step {step}: token {tok} trails the reference's best by {gap:.2e}",
            )
            for step, tok, _, gap in oracle.violations_in(logits, gen, TOKEN_TOL)
        ]
        expected = torch.log_softmax(
            oracle.incremental_logits(reference, prompt, gen) if stateful else logits, dim=-1
        )
        tol = STATEFUL_LOGPROB_TOL if stateful else LOGPROB_TOL
        found += [
            (step, 1, f"prompt {i} step {step}: logprob off by {err:.2e}")
            for step, err in oracle.logprob_errors(expected, gen, out.completions[0].logprobs)
            if err > tol
        ]
        problems += [text for *_, text in sorted(found)]
    return problems


def check_type(model_type: str, multimodal: bool = False) -> Result:
    """Build the tiny model of ``model_type``, patch it and compare it with transformers."""
    from ..engine.binding import patch_state
    from ..requests.sampling_params import SamplingParams
    from .capability import UnsupportedModelError
    from .patching import Engine, patch, unpatch

    result = Result(model_type, "no tiny model", multimodal=multimodal)
    try:
        model = build_tiny_model(model_type, multimodal)
        result.model_class = type(model).__name__
        reference = copy.deepcopy(model)
        prompts = prompt_ids(model)
    except Exception as e:  # noqa: BLE001 - transformers itself cannot build this tiny config
        result.reason = _one_line(f"{type(e).__name__}: {e}")
        return result
    try:
        patch(model)
    except UnsupportedModelError as e:
        result.verdict, result.reason = "refused", _one_line(str(e))
        return result
    except Exception as e:  # noqa: BLE001
        result.verdict, result.reason = "error", _one_line(f"patch raised {type(e).__name__}: {e}")
        return result
    try:
        with torch.no_grad():
            reference(input_ids=torch.tensor([prompts[1]]), use_cache=False)
    except Exception as e:  # noqa: BLE001 - patch took it, but transformers cannot run it: no oracle
        result.reason = _one_line(f"transformers' own forward fails: {type(e).__name__}: {e}")
        return result
    try:
        layout, state = patch_state(model).layout, patch_state(model).state
        for name, settings in SETTINGS.items():
            engine = Engine(model, **settings)
            params = SamplingParams(
                max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
            )
            problems = compare(
                reference, prompts, engine.generate(prompts, params), stateful=state is not None
            )
            if problems:
                result.verdict = "wrong"
                result.reason = _one_line(
                    f"{name}: {len(problems)} mismatch(es): " + "; ".join(problems[:2])
                )
                return result
        unpatch(model)
        x = torch.tensor([prompts[2]])
        with torch.no_grad():
            if not torch.equal(
                model(input_ids=x, use_cache=False).logits,
                reference(input_ids=x, use_cache=False).logits,
            ):
                result.verdict, result.reason = (
                    "wrong",
                    "after unpatch the logits differ from the never-patched model's",
                )
                return result
        result.verdict, result.reason = "pass", _features(layout, state)
    except Exception as e:  # noqa: BLE001
        result.verdict, result.reason = "error", _one_line(f"{type(e).__name__}: {e}")
    return result


def _features(layout: Any, state: Any = None) -> str:
    """What the paged path had to honour for this model (the notable parts of its layout)."""
    specs = layout.layers
    notes = []
    if state is not None:
        chunks = "" if state.continues_chunks else ", prompts continued token by token"
        chunks += "".join(f", decode through paged_hf's {k} kernel" for k in state.kernels)
        notes.append(f"state: {', '.join(state.kinds)} on {len(state.mixers)} layers{chunks}")
    if any(s.k_dim != s.v_dim for s in specs):
        s = next(s for s in specs if s.k_dim != s.v_dim)
        notes.append(f"K/V widths {s.k_dim}/{s.v_dim} (MLA)")
    if len({(s.q_heads, s.kv_heads, s.k_dim, s.v_dim) for s in specs}) > 1:
        notes.append("per-layer heads / widths")
    windows = sorted({s.window for s in specs if s.window})
    if windows:
        notes.append(f"sliding window on {sum(1 for s in specs if s.window)}/{len(specs)} layers")
    if any(s.chunk for s in specs):
        notes.append(f"chunked attention on {sum(1 for s in specs if s.chunk)}/{len(specs)} layers")
    if any(s.sinks for s in specs):
        notes.append("attention sinks")
    if any(s.kv_heads == 1 < s.q_heads for s in specs):
        notes.append("MQA")
    elif any(1 < s.kv_heads < s.q_heads for s in specs):
        notes.append("GQA")
    return ", ".join(notes)


def _one_line(text: str, limit: int = 300) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """Raise TimeoutError after ``seconds`` (main thread, POSIX); no limit elsewhere."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def stop(*_: Any) -> None:
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_sweep(
    types: list[str] | None = None,
    multimodal: tuple[str, ...] | list[str] | None = None,
    per_type_seconds: int = 300,
    progress: Any = None,
) -> list[Result]:
    """``check_type`` for each type (default: all causal LM types, then MULTIMODAL_TYPES' text paths)."""
    import logging

    from transformers.utils import logging as hf_logging

    types = causal_lm_types() if types is None else list(types)
    multimodal = MULTIMODAL_TYPES if multimodal is None else tuple(multimodal)
    results = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    paged_logger = logging.getLogger("paged_hf")
    level = paged_logger.level
    # a refused or failed request is the result here, not news
    paged_logger.setLevel(logging.CRITICAL)
    try:
        for kind, names in ((False, types), (True, multimodal)):
            for model_type in names:
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        with _time_limit(per_type_seconds):
                            result = check_type(model_type, multimodal=kind)
                    except TimeoutError as e:
                        result = Result(model_type, "error", str(e), multimodal=kind)
                result.seconds = round(time.perf_counter() - start, 2)
                results.append(result)
                if progress is not None:
                    progress(result)
    finally:
        hf_logging.set_verbosity(verbosity)
        paged_logger.setLevel(level)
    return results


# ---- the support page's table ----------------------------------------------------------------------------------
TABLE_START = (
    "<!-- support-table:start (python -m paged_hf.model.support --page docs/support.md) -->"
)
TABLE_END = "<!-- support-table:end -->"


def counts(results: list[Result]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        out[r.verdict] = out.get(r.verdict, 0) + 1
    return out


def render_table(results: list[Result], transformers_version: str) -> str:
    causal = [r for r in results if not r.multimodal]
    mm = [r for r in results if r.multimodal]
    c = counts(causal)
    order = ("pass", "refused", "wrong", "error", "no tiny model")
    summary = ", ".join(
        f"**{c.get(v, 0)} {v}**" if v == "pass" else f"{c.get(v, 0)} {v}" for v in order
    )
    lines = [
        TABLE_START,
        "",
        f"transformers {transformers_version}, all {len(causal)} `model_type`s of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: "
        f"{summary}.",
        "",
    ]
    if mm:
        cm = counts(mm)
        lines += [
            "Text path of image-text models (`AutoModelForImageTextToText`, text-only prompts): "
            + ", ".join(f"{cm.get(v, 0)} {v}" for v in order if cm.get(v))
            + ".",
            "",
        ]
    for title, rows in (("causal LM type", causal), ("image-text model's text path", mm)):
        if not rows:
            continue
        lines += [
            "<details>",
            f"<summary>Every {title}: class, verdict, what it needed or why not</summary>",
            "",
            "| type | class | verdict | details |",
            "| --- | --- | --- | --- |",
        ]
        for r in rows:
            reason = r.reason.replace("|", "\\|")
            lines.append(f"| {r.model_type} | {r.model_class} | {r.verdict} | {reason} |")
        lines += ["", "</details>", ""]
    lines.append(TABLE_END)
    return "\n".join(lines)


def write_page(path: str | Path, table: str) -> None:
    path = Path(path)
    text = path.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{path} has no support-table markers ({TABLE_START!r} ... {TABLE_END!r})")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(head + table + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paged_hf.model.support", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "types",
        nargs="*",
        help="model types (default: every causal LM type, then the text path of "
        f"{', '.join(MULTIMODAL_TYPES)})",
    )
    parser.add_argument(
        "--multimodal", nargs="*", default=None, help="image-text types whose text path to check"
    )
    parser.add_argument("--json", help="write the results here (one object per type)")
    parser.add_argument(
        "--page",
        help="rewrite the support table between the markers in this file (docs/support.md)",
    )
    parser.add_argument("--from-json", help="no sweep: render --page from a file --json wrote")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--per-type-seconds", type=int, default=300)
    args = parser.parse_args(argv)
    import transformers

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results = [Result(**row) for row in saved["results"]]
        if args.page:
            write_page(args.page, render_table(results, saved["transformers"]))
        return 0
    torch.set_num_threads(args.threads)
    multimodal = (
        args.multimodal if args.multimodal is not None else (None if not args.types else [])
    )
    results = run_sweep(
        args.types or None,
        multimodal,
        args.per_type_seconds,
        progress=lambda r: print(
            f"{r.model_type:28s} {r.verdict:8s} {r.seconds:6.1f}s  {r.reason}", flush=True
        ),
    )
    print(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "causal": counts([r for r in results if not r.multimodal]),
                "multimodal text path": counts([r for r in results if r.multimodal]),
            }
        )
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"transformers": transformers.__version__, "results": [r.row() for r in results]},
                indent=1,
            )
        )
    if args.page:
        write_page(args.page, render_table(results, transformers.__version__))
    bad = [r for r in results if r.verdict in ("wrong", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
