"""Each attention layer's KV geometry, read from the probe: heads, widths, window, chunk, sinks;
what paged attention cannot apply is refused, naming the module.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import (
    sdpa_mask,
)

from ..execution.kv_geometry import KVLayout, LayerSpec
from ..execution.runner import max_positions
from .probe import PROBE_TOKENS, ProbeCall, ProbeRecord, module_names, probe_token_ids, refuse
from .state_probe import attention_cache_layers

# keywords an attention layer may pass: honoured by the paged kernels, or inert at inference
HONOURED_KWARGS = ("scaling", "sliding_window", "softcap", "s_aux", "dropout")


INERT_KWARGS = (
    "position_ids",
    "use_cache",
    "output_attentions",
    "output_router_logits",
    "output_hidden_states",
    "return_dict",
    "cache_position",
    "is_causal",
    "layer_idx",
    "logits_to_keep",
)


def kv_layout(
    model: torch.nn.Module, probe: ProbeRecord, model_name: str, sparse: bool = False
) -> tuple[KVLayout, list[Any], tuple[tuple[str, int], ...]]:
    """``sparse``: a hybrid's attention layers need not be numbered 0..n-1 (stateful layers sit between)."""
    names = module_names(model)
    max_pos = max_positions(model)[1] or (1 << 17)
    by_layer: dict[int, LayerSpec] = {}
    configs: dict[int, Any] = {}
    windows_cache: dict[int, tuple[int | None, int | None]] = {}
    _refuse_repeated_calls(probe, names, model_name)
    layers = _attention_layers(model, probe, model_name)
    for call in probe.calls:
        m = call.module
        module_path = f"{names.get(id(m), '?')} ({type(m).__name__})"
        layer_idx = layers[id(m)]
        by_layer[layer_idx] = _layer_spec(
            call, module_path, model_name, probe, max_pos, windows_cache
        )
        cfg = getattr(m, "config", None)
        if cfg is not None:
            configs[id(cfg)] = cfg
    ids = sorted(by_layer)
    if ids != list(range(len(by_layer))) and not sparse:
        raise refuse(
            model_name,
            "its attention layers",
            f"layer_idx values {ids} are not 0..{len(by_layer) - 1}",
        )
    layer_ids = None if ids == list(range(len(ids))) else tuple(ids)
    tagged = tuple(
        (names[id(m)], layers[id(m)])
        for m in {id(c.module): c.module for c in probe.calls}.values()
        if layers[id(m)] != getattr(m, "layer_idx", None)
    )
    return (
        KVLayout(tuple(by_layer[i] for i in ids), layer_ids, stateless_ok=sparse),
        list(configs.values()),
        tagged,
    )


def _layer_spec(
    call: Any,
    module_path: str,
    model_name: str,
    probe: ProbeRecord,
    max_pos: int,
    windows_cache: dict[int, tuple[int | None, int | None]],
) -> LayerSpec:
    """One attention call's layer, as the probe saw it; what paged attention cannot apply is
    refused, naming the module."""
    _refuse_what_paging_drops(call, module_path, model_name)
    n = PROBE_TOKENS
    q, k, v = call.query, call.key, call.value
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise refuse(
            model_name,
            module_path,
            f"passes query/key/value of shapes {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}; paged attention takes [1, heads, tokens, head_dim]",
        )
    if q.shape[2] != n or k.shape[2] != n or v.shape[2] != n:
        raise refuse(
            model_name,
            module_path,
            f"attends {k.shape[2]} keys for {q.shape[2]} queries of a {n}-token input "
            "(cross-attention or extra memory tokens)",
        )
    hq, hkv, dq, dk, dv = q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3]
    if v.shape[1] != hkv or dq != dk or hkv < 1 or hq % hkv:
        raise refuse(
            model_name,
            module_path,
            f"query/key/value heads {hq}/{hkv}/{v.shape[1]} and widths {dq}/{dk}/{dv} "
            "do not form (grouped-query) attention",
        )
    sinks = call.kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != hq):
        raise refuse(
            model_name,
            module_path,
            f"passes attention sinks (s_aux) of shape {getattr(sinks, 'shape', None)}; "
            f"paged attention takes one sink logit per query head ({hq})",
        )
    window, chunk = _mask_pattern(probe, call, module_path, model_name, max_pos, windows_cache)
    _refuse_disagreeing_window(call, window, chunk, max_pos, module_path, model_name)
    return LayerSpec(
        q_heads=hq,
        kv_heads=hkv,
        k_dim=dk,
        v_dim=dv,
        window=window,
        chunk=chunk,
        sinks=sinks is not None,
    )


def _refuse_what_paging_drops(call: Any, module_path: str, model_name: str) -> None:
    """Keywords paged attention would not apply, and bidirectional attention."""
    m = call.module
    unknown = sorted(
        k
        for k, v in call.kwargs.items()
        if k not in HONOURED_KWARGS + INERT_KWARGS and v is not None
    )
    if unknown:
        raise refuse(
            model_name,
            module_path,
            f"passes {unknown} to its attention function, which paged attention does not "
            "apply (e.g. a position bias)",
        )
    if call.kwargs.get("is_causal") is False or getattr(m, "is_causal", True) is False:
        raise refuse(
            model_name,
            module_path,
            "is not causal (is_causal=False): bidirectional attention cannot be paged",
        )


def _refuse_disagreeing_window(
    call: Any,
    window: int | None,
    chunk: int | None,
    max_pos: int,
    module_path: str,
    model_name: str,
) -> None:
    """The ``sliding_window`` a layer passes must be the window its mask has."""
    kw_window = call.kwargs.get("sliding_window")
    if kw_window is not None and window is not None and int(kw_window) != window:
        raise refuse(
            model_name,
            module_path,
            f"passes sliding_window={kw_window} but transformers masks it with a window of "
            f"{window}; the two disagree",
        )
    if kw_window is not None and window is None and chunk is None and 0 < int(kw_window) < max_pos:
        raise refuse(
            model_name,
            module_path,
            f"passes sliding_window={kw_window} but its mask has no window; the two disagree",
        )


def _refuse_repeated_calls(probe: ProbeRecord, names: dict[int, str], model_name: str) -> None:
    seen: set[int] = set()
    for call in probe.calls:
        if id(call.module) in seen:
            raise refuse(
                model_name,
                f"{names.get(id(call.module), '?')} ({type(call.module).__name__})",
                "attends more "
                "than once per forward (a second attention map, or a block reused across layers); each call "
                "would need its own KV",
            )
        seen.add(id(call.module))


def _attention_layers(
    model: torch.nn.Module, probe: ProbeRecord, model_name: str
) -> dict[int, int]:
    """id(module) -> the layer each attention module's KV is kept under: its ``layer_idx``, or, where that
    does not tell it from the others (none, or another module's too), the one layer transformers' own
    cache keeps its K and V under (a block shared across layers: Zamba2 builds one module per
    application, weights tied, every one with layer_idx -1, and passes the depth to its forward)."""
    names = module_names(model)
    modules = list({id(c.module): c.module for c in probe.calls}.values())
    own = {id(m): getattr(m, "layer_idx", None) for m in modules}
    named = [v for v in own.values() if isinstance(v, int) and not isinstance(v, bool)]
    unnamed = [m for m in modules if own[id(m)] not in named or named.count(own[id(m)]) > 1]
    if not unnamed:
        return own
    ids = torch.tensor(
        [probe_token_ids(model, PROBE_TOKENS)], device=next(model.parameters()).device
    )
    try:
        kept, failed = attention_cache_layers(model, ids), ""
    except Exception as e:  # noqa: BLE001 - no cache to tell them apart: said below
        kept, failed = {}, f"a forward through its own cache failed ({type(e).__name__}: {e})"
    layers = dict(own)
    for m in unnamed:
        got = sorted(
            kept.get(id(m), ()),
            key=lambda v: (not isinstance(v, int), v if isinstance(v, int) else 0),
        )
        if len(got) == 1 and isinstance(got[0], int) and not isinstance(got[0], bool):
            layers[id(m)] = got[0]
            continue
        module_path = f"{names.get(id(m), '?')} ({type(m).__name__})"
        why = failed or (
            f"transformers' own cache keeps its K and V under layers {got}"
            if got
            else "it writes no K and V to transformers' own cache"
        )
        if own[id(m)] not in named:
            raise refuse(
                model_name,
                module_path,
                f"calls attention without a layer_idx, and {why}: it is not a per-layer "
                "attention over the sequence's tokens (e.g. attention over earlier layers' outputs)",
            )
        raise refuse(
            model_name,
            module_path,
            f"has the layer_idx ({own[id(m)]}) of another attention module (a block shared "
            f"across layers, or stacks that number their layers alike), and {why}; their KV would "
            "overwrite each other",
        )
    taken: dict[int, torch.nn.Module] = {}
    for m in modules:
        other = taken.setdefault(layers[id(m)], m)
        if other is not m:
            raise refuse(
                model_name,
                f"{names.get(id(m), '?')} ({type(m).__name__})",
                f"its KV would be kept as layer "
                f"{layers[id(m)]}'s, as {names.get(id(other), '?')}'s is; they would overwrite each other",
            )
    return layers


def _mask_pattern(
    probe: ProbeRecord,
    call: ProbeCall,
    module_path: str,
    model_name: str,
    max_pos: int,
    cache: dict[int, tuple[int | None, int | None]],
) -> tuple[int | None, int | None]:
    """(window, chunk) of the mask transformers built for this call, evaluated up to ``max_pos``."""
    mask = call.mask
    if mask is None:
        # no mask: the attention function's own causal masking (module.is_causal is True)
        return (
            None,
            None,
        )
    entry = probe.masks.get(id(mask)) if isinstance(mask, torch.Tensor) else None
    if entry is None:
        raise refuse(
            model_name,
            module_path,
            "passes an attention mask or bias it builds itself (not one of transformers' mask "
            "functions), which paged attention would drop",
        )
    if id(mask) not in cache:
        cache[id(mask)] = _classify(entry[1], entry[2], max_pos, model_name, module_path)
    return cache[id(mask)]


def _query_positions(max_pos: int) -> list[int]:
    qs = set(range(0, 18))
    p = 16
    while p < max_pos:
        qs.update((p - 1, p, p + 1, p + p // 2))
        p *= 2
    qs.add(max_pos - 1)
    return sorted(q for q in qs if 0 <= q < max_pos)


def _classify(
    mask_function: Any, use_vmap: bool, max_pos: int, model_name: str, module_path: str
) -> tuple[int | None, int | None]:
    """Read a mask function's pattern: full causal, a sliding window, or chunks; refuse anything else."""
    lows: dict[int, int] = {}
    for q in _query_positions(max_pos):
        try:
            row = sdpa_mask(
                batch_size=1,
                q_length=1,
                kv_length=q + 3,
                q_offset=q,
                kv_offset=0,
                mask_function=mask_function,
                attention_mask=None,
                allow_is_causal_skip=False,
                use_vmap=use_vmap,
            )
        except Exception as e:  # noqa: BLE001
            raise refuse(
                model_name,
                module_path,
                "its attention mask depends on per-token inputs (a multimodal overlay of token "
                "types or blocks), so its window cannot be read past the probe "
                f"({type(e).__name__}: {e})",
            ) from e
        seen = row.reshape(-1).nonzero().flatten().tolist()
        if not seen or seen[-1] != q:
            raise refuse(
                model_name,
                module_path,
                f"its mask {'lets query ' + str(q) + ' see later keys' if seen and seen[-1] > q else 'hides a query from itself'}"
                ": not causal attention (a bidirectional prefix or an encoder)",
            )
        if seen != list(range(seen[0], q + 1)):
            raise refuse(
                model_name,
                module_path,
                f"its mask for query {q} is not a contiguous run of keys (a custom pattern)",
            )
        lows[q] = seen[0]
    if all(lo == 0 for lo in lows.values()):
        return None, None
    widths = {q - lo + 1 for q, lo in lows.items() if lo > 0}
    if len(widths) == 1:
        w = widths.pop()
        if all(lo == max(0, q - w + 1) for q, lo in lows.items()):
            return w, None
    c = min(lo for lo in lows.values() if lo > 0)
    if all(lo == (q // c) * c for q, lo in lows.items()):
        return None, c
    raise refuse(
        model_name, module_path, "its mask is causal but neither full, a sliding window nor chunked"
    )
