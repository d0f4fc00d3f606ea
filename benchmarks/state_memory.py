"""How much a hybrid model's recurrent state costs per sequence, at the shapes of transformers' own
default configs (the released models' shapes), against its attention layers' KV.

    python benchmarks/state_memory.py                    # table + benchmarks/results/state_memory.json
    python benchmarks/state_memory.py --types qwen3_5_text lfm2

Each model is built on the meta device (no memory, no weights) and the state shapes are read the
way ``paged_hf.patch`` reads them: one forward through the cache the model builds for itself
(paged_hf/model/state_probe.py). The engine keeps one state slot per sequence that may run, and
by default lets the slots take at most half of ``kv_cache_memory``; the last columns say how many
sequences' states half of 24 and of 80 GiB hold.
"""

from __future__ import annotations

import sys
import warnings

import common
import torch

from paged_hf.model.state_probe import probe_state_layout

TYPES = ["qwen3_5_text", "qwen3_next", "kimi_linear", "falcon_h1", "lfm2"]
# where transformers' default config is not a released model's layer pattern
# six attention layers in LFM2, as released (its default config has none)
OVERRIDES = {"lfm2": dict(full_attn_idxs=[2, 5, 8, 10, 12, 14])}
GIB = 1 << 30


def measure(model_type: str, dtype: torch.dtype) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {}))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]], device="meta")
    layout = probe_state_layout(model, ids, check_chunks=False)
    text = config.get_text_config()
    kinds = list(getattr(text, "layer_types", []) or [])
    full = sum(1 for k in kinds if "attention" in k and k != "linear_attention")
    attention = full or kinds.count("hybrid")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    kv_per_token = attention * kv_heads * head_dim * 2 * torch.empty((), dtype=dtype).element_size()
    state = layout.bytes_per_slot()
    return {
        "type": model_type,
        "layers": len(kinds),
        "stateful layers": len(layout.mixers),
        "state kind": ", ".join(layout.kinds),
        "state MiB / sequence": state / (1 << 20),
        "attention layers": attention,
        "KV KiB / token": kv_per_token / 1024,
        "state = KV of tokens": state / kv_per_token if kv_per_token else None,
        "states in 12 GiB (half of 24)": int(12 * GIB // state),
        "states in 40 GiB (half of 80)": int(40 * GIB // state),
    }


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--types", nargs="*", default=TYPES)
    parser.add_argument("--json", default="benchmarks/results/state_memory.json")
    args = parser.parse_args()
    rows = [measure(t, torch.bfloat16) for t in args.types]
    cells = [
        [f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else v for v in r]
        for r in (row.values() for row in rows)
    ]
    print(common.md_table(list(rows[0]), cells))
    common.write_json(args.json, {"dtype": "bfloat16", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
