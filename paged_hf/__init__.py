"""paged_hf: paged KV cache, continuous batching and prefix reuse for HuggingFace causal LMs.

    import paged_hf
    model = paged_hf.patch(model)                       # one line
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

    engine = paged_hf.Engine(model, tokenizer)          # or drive the engine directly
    engine.generate(["Hello"], paged_hf.SamplingParams(max_new_tokens=32, stop=["\n\n"]))
    engine.score([("The capital of France is", " Paris")])   # loglikelihood of a continuation

Where things live (the four roles of the design):
  block pool + prefix index  block_pool.py, prefix_index.py, block_manager.py
  request state              request.py, sampling_params.py, outputs.py; detokenizer.py (incremental
                             detokenization, stop strings)
  scheduler                  scheduler.py
  execution backend          runner.py, metadata.py, attention.py, backends/, sampler.py,
                             kv_geometry.py (per-layer KV layout);
                             on CPU: backends/cpu_paged_attention.py + csrc/ (the paged attention op);
                             on CUDA: cuda_graphs.py, compile_decode.py, cuda_memory.py
  the model side             patching.py (patch / unpatch / paged_hf.Engine), capability.py (can this
                             model run? what is its KV layout?), patches/ (per-family quirks),
                             support.py (the support table over every transformers causal LM);
                             binding.py is what patching leaves on a model for the engine
  front ends                 engine.py, hf_generate.py, datasets_eval.py (generate_dataset),
                             serve.py (background engine), cli.py (paged-hf), scoring.py (Engine.score,
                             score_rolling, prompt logprobs), integrations/lm_eval.py (lm-eval backend)

Imports run one way: the model side imports the engine side, never the reverse.
"""
from .config import EngineConfig
from .frontends.datasets_eval import generate_dataset
from .engine.outputs import Completion, RequestOutput
from .model.patching import Engine, UnsupportedModelError, engine_for, is_patched, patch, unpatch
from .requests.sampling_params import SamplingParams
from .engine.scoring import ScoreOutput
from .frontends.serve import serve

__all__ = ["Completion", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "ScoreOutput",
           "UnsupportedModelError", "engine_for", "generate_dataset", "is_patched", "patch", "serve", "unpatch"]
__version__ = "0.1.0"
