"""TRL's online trainers (GRPOTrainer, RLOOTrainer) generating through paged_hf.

    from trl import GRPOConfig, GRPOTrainer
    from paged_hf.integrations.trl import PagedGenerationMixin

    class PagedGRPOTrainer(PagedGenerationMixin, GRPOTrainer):
        paged_hf_options = {"kv_cache_memory": 1 << 30}   # engine options (paged_hf.EngineConfig)

    trainer = PagedGRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...)

The mixin replaces TRL's plain ``model.generate`` path (not its vLLM one): each prompt's
``num_generations`` completions are one request with ``n = num_generations``, so they share the
prompt's KV, sampled with TRL's generation config; the sampled tokens' logprobs under the
distribution actually sampled (``logprobs_mode="processed"``, what vLLM returns to TRL) come back
where TRL's vLLM path puts vLLM's (TRL applies its importance-sampling correction only on that
path). The model may stay in train mode: engine forwards run with dropout off. Weights are never
stale: every optimizer step on the model's parameters (torch's fused AdamW included) marks the
engine's derived state stale (paged_hf/cache/coherence.py), and PEFT adapters are part of the
prefix cache's key. Between generations the engine sleeps (``Engine.sleep``: its KV memory is let
go for the training step that follows); ``paged_hf_sleep = False`` keeps it.

Unsupported here, and left to TRL's own path: images and other multimodal inputs, tool-calling
turns that generate one completion per sample (``num_generations=1`` calls run through the engine
too), and the vLLM path itself.
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
