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
  execution backend          runner.py, metadata.py, attention.py, backends/, sampler.py;
                             on CUDA: cuda_graphs.py, compile_decode.py, cuda_memory.py
  front ends                 engine.py, hf_generate.py, patching.py, datasets_eval.py (generate_dataset),
                             serve.py (background engine), cli.py (paged-hf), scoring.py (Engine.score,
                             score_rolling, prompt logprobs), integrations/lm_eval.py (lm-eval backend)
"""
from .config import EngineConfig
from .datasets_eval import generate_dataset
from .engine import Engine
from .outputs import Completion, RequestOutput
from .patching import engine_for, is_patched, patch, unpatch
from .sampling_params import SamplingParams
from .scoring import ScoreOutput
from .serve import serve

__all__ = ["Completion", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "ScoreOutput", "engine_for",
           "generate_dataset", "is_patched", "patch", "serve", "unpatch"]
__version__ = "0.1.0"
