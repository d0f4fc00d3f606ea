"""The engine: admission, the step loop, the scheduler, outputs and scoring.

engine.py     Engine: builds the pool, scheduler and runner; weight coherence, stats
admission.py  validate a request, make its id, tokenize it
step.py       one step: schedule -> execute -> sample -> update, and failure handling
outputs.py    Completion / RequestOutput, assembled from a finished request
batch.py      the blocking calls: generate, score, score_rolling, run_until_done
scheduler.py  waiting / running queues, token budget, chunked prefill, preemption
call_group.py one generate call's rows in lock-step: stopping criteria, joint token choice
beam_group.py beam search as a call's group: transformers' search, beams sharing blocks
scoring.py    loglikelihood of continuations, rolling loglikelihood, prompt logprobs
binding.py    what patching leaves on a model for the engine (the engine never imports the model side)
"""

from .engine import Engine

__all__ = ["Engine"]
