"""paged_hf: paged KV cache, continuous batching and prefix reuse for HuggingFace causal LMs.

    import paged_hf
    model = paged_hf.patch(model)                       # one line
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

    engine = paged_hf.Engine(model, tokenizer)          # or drive the engine directly
    engine.generate(["Hello"], paged_hf.SamplingParams(max_new_tokens=32, stop=["\n\n"]))
    engine.score([("The capital of France is", " Paris")])   # loglikelihood of a continuation

The package's map and one step's data flow: docs/architecture.md.
"""

from .config import EngineConfig
from .engine.outputs import Completion, RequestOutput
from .engine.schedule_output import QueueFull
from .engine.scoring import ScoreOutput
from .execution import attention as _attention
from .frontends.dataset_generation import generate_dataset
from .frontends.serve import serve
from .model.patching import Engine, UnsupportedModelError, engine_for, is_patched, patch, unpatch
from .requests.sampling_params import SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "QueueFull",
    "RequestOutput",
    "SamplingParams",
    "ScoreOutput",
    "UnsupportedModelError",
    "engine_for",
    "generate_dataset",
    "is_patched",
    "patch",
    "serve",
    "unpatch",
]
__version__ = "0.1.0"

# "paged_hf" is a valid attn_implementation from import on: a model loaded with it (TRL's reference
# model copies its policy's) runs plain forwards through sdpa, or what patched models of its class had
_attention.register()
