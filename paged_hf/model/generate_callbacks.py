"""A patched ``generate`` call's callbacks and transformers-only options, run as transformers runs them.

Design notes: docs/internals.md, paged_hf/model/generate_callbacks.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

from ..requests.sampling_params import SamplingParams
from .beam_call import BeamCall
from .call_rows import CallRows
from .generate_options import JOINT_OUTPUTS, JOINT_SAMPLING_SETTINGS, JOINT_SETTINGS
from .lock_step_calls import CriteriaCall, JointCall

GenerateCall = CriteriaCall | JointCall | BeamCall  # a generate call whose rows move in lock-step


@dataclass
class CallPlan:
    call: GenerateCall | None  # its rows' lock-step call, where its callbacks need one
    params: SamplingParams  # what each row runs with
    eos: list[int]  # EOS ids the engine ends a row on itself
    native_stops: bool  # whether the engine matches stop strings itself

    @property
    def joint(self) -> bool:
        """Whether the call picks its rows' tokens itself (and so gives the call's output)."""
        return isinstance(self.call, (JointCall, BeamCall))


def joint_reasons(
    gc: GenerationConfig, logits_processor: Any, prefix_allowed_tokens_fn: Any
) -> list[str]:
    """What makes a call pick its rows' tokens with transformers' processors (empty: the engine's own)."""
    reasons = [f"num_beams={gc.num_beams}"] if (gc.num_beams or 1) > 1 else []
    reasons += [
        f"{name}={getattr(gc, name)!r}"
        for name, neutral in JOINT_SETTINGS.items()
        if getattr(gc, name, neutral) not in (None, neutral)
    ]
    if gc.do_sample:
        reasons += [
            f"{name}={getattr(gc, name)!r}"
            for name, neutral in JOINT_SAMPLING_SETTINGS.items()
            if getattr(gc, name, neutral) not in (None, neutral)
        ]
    if gc.return_dict_in_generate:
        reasons += [name for name in JOINT_OUTPUTS if getattr(gc, name)]
    if logits_processor is not None and len(logits_processor) > 0:
        reasons.append("logits_processor")
    if prefix_allowed_tokens_fn is not None:
        reasons.append("prefix_allowed_tokens_fn")
    return reasons


def plan_call(
    model: torch.nn.Module,
    gc: GenerationConfig,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    pad: int,
    eos: list[int],
    tokenizer: Any,
    logits_processor: Any,
    stopping_criteria: Any,
    prefix_allowed_tokens_fn: Any,
) -> CallPlan:
    joint = joint_reasons(gc, logits_processor, prefix_allowed_tokens_fn)
    has_criteria = stopping_criteria is not None and len(stopping_criteria) > 0
    if not joint and not has_criteria and gc.max_time is None:
        return CallPlan(None, params, eos, native_stops=True)
    width = input_ids.shape[1]
    gc = copy.deepcopy(gc)
    gc.max_length = width + params.max_new_tokens
    model._prepare_special_tokens(gc, True, device=input_ids.device)
    criteria = model._get_stopping_criteria(
        gc, StoppingCriteriaList(stopping_criteria or []), tokenizer
    )
    pads = any(hasattr(c, "eos_token_id") for c in criteria)
    max_new = params.max_new_tokens
    for c in criteria:  # a caller's criterion of the same type replaces transformers' (its merge)
        if isinstance(c, MaxLengthCriteria) and c.max_length > gc.max_length:
            max_new = c.max_length - width
        if isinstance(c, EosTokenCriteria) and (
            gc._eos_token_tensor is None
            or not torch.equal(c.eos_token_id.cpu(), gc._eos_token_tensor.cpu())
        ):
            eos = c.eos_token_id.flatten().tolist()
    if not joint:
        call = CriteriaCall(
            CallRows(input_ids, params.n, max_new, pad, pads, input_ids.device), criteria
        )
        return CallPlan(call, params.with_(max_new_tokens=max_new), eos, native_stops=True)
    if params.constraint is not None:
        raise NotImplementedError(
            f"paged_hf generate: structured outputs together with {joint[0]} are not supported"
        )
    processors = model._get_logits_processor(
        generation_config=gc,
        input_ids_seq_length=width,
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=LogitsProcessorList(logits_processor or []),
        device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask},
    )
    if (gc.num_beams or 1) > 1:
        return _beam_plan(model, gc, input_ids, criteria, processors, max_new)
    call = JointCall(
        CallRows(input_ids, params.n, max_new, pad, pads, input_ids.device),
        criteria,
        processors,
        bool(gc.do_sample),
        scores=bool(gc.return_dict_in_generate and gc.output_scores),
        logits=bool(gc.return_dict_in_generate and gc.output_logits),
    )
    # the call does everything transformers' loop does; each row only computes its logits
    each_row = SamplingParams(
        max_new_tokens=max_new,
        n=params.n,
        ignore_eos=True,
        output_hidden_states=params.output_hidden_states,
    )
    return CallPlan(call, each_row, [], native_stops=False)


def _beam_plan(
    model: torch.nn.Module,
    gc: GenerationConfig,
    input_ids: torch.Tensor,
    criteria: Any,
    processors: Any,
    max_new: int,
) -> CallPlan:
    """Beam search: each prompt's beams are the samples of one request (forked from its prompt's
    blocks), and the call runs transformers' beam search over their logits
    (paged_hf/model/beam_call.py)."""
    from ..engine.binding import patch_state

    state = patch_state(model)
    if state is not None and state.state is not None:
        raise NotImplementedError(
            "paged_hf generate: beam search on a model with recurrent / convolution state "
            "layers is not supported (a beam would have to copy its parent's state each step)"
        )
    gc.max_length = input_ids.shape[1] + max_new
    call = BeamCall(
        input_ids,
        criteria,
        processors,
        model,
        gc,
        scores=bool(gc.return_dict_in_generate and gc.output_scores),
        logits=bool(gc.return_dict_in_generate and gc.output_logits),
        device=input_ids.device,
    )
    return CallPlan(
        call,
        SamplingParams(max_new_tokens=max_new, n=gc.num_beams, ignore_eos=True),
        [],
        native_stops=False,
    )
