"""TRL's online trainers (GRPOTrainer, RLOOTrainer) generating through paged_hf.

Design notes: docs/internals.md, paged_hf/integrations/trl.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..model.patching import engine_for, is_patched, patch
from ..requests.sampling_params import SamplingParams


class PagedGenerationMixin:
    """Put it before the trainer class: ``class T(PagedGenerationMixin, GRPOTrainer)``."""

    paged_hf_options: dict[str, Any] = {}
    paged_hf_sleep: bool = True

    def paged_engine(self):
        """The engine over the unwrapped policy (the PeftModel itself for PEFT), patched on first use."""
        model = self.accelerator.unwrap_model(self.model)
        if not is_patched(model):
            patch(model, getattr(self, "processing_class", None), **self.paged_hf_options)
        return engine_for(model)

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        n = num_generations
        if (
            getattr(self, "use_vllm", False)
            or images is not None
            and any(images)
            or multimodal_fields
            or has_tool_images
            or n < 1
            or len(prompt_ids) % n
            or any(prompt_ids[i] != prompt_ids[i - i % n] for i in range(len(prompt_ids)))
        ):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        engine = self.paged_engine()
        params = SamplingParams.from_generation_config(
            self.generation_config,
            n=n,
            logprobs=0,
            logprobs_mode="processed",
            max_new_tokens=self.generation_config.max_new_tokens or self.max_completion_length,
            stop_token_ids=tuple(getattr(self, "eos_token_ids", ()) or ()),
        )
        with torch.no_grad():
            outputs = engine.generate([list(p) for p in prompt_ids[::n]], params)
        if self.paged_hf_sleep:
            engine.sleep()
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"paged_hf generation failed: {failed[0]}")
        completions = [c for o in outputs for c in o.completions]
        return [list(c.token_ids) for c in completions], [
            [lp for lp, _ in c.logprobs] for c in completions
        ]
