"""Front ends: the ways in besides ``model.generate``.

datasets_eval.py  generate_dataset: a whole datasets.Dataset, ordered, resumable, sharded
checkpoint.py     the on-disk rows that let a killed run resume
serve.py          the background engine (submit, stream, cancel) for notebooks and services
cli.py            the paged-hf command (python -m paged_hf)
loading.py        a model by name, path or GGUF file, for the CLI and the lm-eval backend
models.py         the embedded default model (SmolLM2-135M-Instruct from its wheel's GGUF)
"""
