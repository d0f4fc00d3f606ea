"""Execution: KV tensors, step metadata, attention, the forward and sampling.

  runner.py          ModelRunner: builds a step's metadata, runs the model's own forward, returns logits
  metadata.py        StepMetadata, the CSR index tensors every backend reads (FlashInfer's format)
  attention.py       the function registered with transformers' AttentionInterface, and its mask seam
  backends/          torch (the reference), the CPU kernel, FlashInfer; swap to host memory
  csrc/              the C++ paged attention op for CPUs
  kv_geometry.py     each layer's K/V layout (heads, widths, windows, sinks)
  sampler.py         greedy / temperature / top-k/p/min-p / penalties, per-request generators
  cpu_linear.py      bf16 linears on weights packed once for oneDNN
  fused_ops.py       RMSNorm, SiLU-and-mul and rotary embedding as one C++ op each, where checked
  compact_layers.py  a pre-norm decoder layer checked to be the canonical block: its ops called directly
  cpu_kv_memory.py, cpu_malloc.py   the CPU KV pool's pages and the allocator between steps
  cuda_graphs.py, compile_decode.py, cuda_memory.py   the CUDA decode step and KV sizing

It decides nothing about what runs: the engine hands it the scheduled requests.
"""
