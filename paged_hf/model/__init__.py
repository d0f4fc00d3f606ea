"""The model side: can this model run, and switching it to paged attention and back.

  patching.py     patch / unpatch / paged_hf.Engine (checks and patches the model first)
  capability.py   the probe forwards that decide support and read each layer's KV layout
  hf_generate.py  the ``generate`` that patch installs: transformers' arguments, run by the engine
  generate_callbacks.py  a call's stopping criteria, logits processors and transformers-only options
  generate_options.py    what generate does with each of transformers' options (the README's table;
                         generate_options_page.py writes it)
  support.py      the support table over every transformers causal LM (python -m paged_hf.model.support)

Per-family quirks live in patches/ (paged_hf.patches). This side imports the engine, never the reverse.
"""
