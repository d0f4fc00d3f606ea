"""The tiers under the prefix cache. Disk (``kv_cache_dir``): prompt blocks computed by one engine
are read back by the next one, in this process or another, with the same tokens as computing them;
nothing is served across weights, adapters, salts or block sizes; a damaged record is recomputed.
Host memory (``kv_host_cache_bytes``, the torch backend standing in for a device): blocks the pool
evicted come back from it."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_state import assert_clean
from tiny_models import make_tiny_model, tiny_prompts

import paged_hf
from paged_hf import SamplingParams
from paged_hf.engine.kv_tiers import record_blocks

BS = 4
LENGTHS = [21, 30, 17, 9, 40]


@pytest.fixture(scope="module")
def prompts(model):
    return tiny_prompts(model.config.vocab_size, len(LENGTHS), LENGTHS, seed=5)


def run(model, prompts, kv_dir, params=None, **options):
    """(tokens per prompt, the engine's stats, the engine) of one engine generating the prompts."""
    engine = paged_hf.Engine(
        model,
        block_size=options.pop("block_size", BS),
        num_blocks=options.pop("num_blocks", 256),
        kv_cache_dir=kv_dir,
        **options,
    )
    outs = engine.generate(prompts, params or SamplingParams(max_new_tokens=6))
    engine.flush_kv_tiers()
    assert_clean(engine)
    return [o.token_ids for o in outs], engine.stats(), engine


P = record_blocks(BS)  # blocks per record

# another process: the tiny llama (the same weights: the same seed) and an engine on argv[1]
_TESTS = Path(__file__).resolve().parents[1]
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_TESTS), str(_TESTS.parent)]))
CHILD_ENGINE = (
    "import paged_hf, sys\n"
    "from tiny_models import make_tiny_model, tiny_prompts\n"
    "from paged_hf import SamplingParams\n"
    "model = make_tiny_model('llama').double()\n"
    f"e = paged_hf.Engine(model, block_size={BS}, num_blocks=256, kv_cache_dir=sys.argv[1])\n"
)


def written_tokens(prompts) -> int:
    """What the tier writes of each prompt: its whole records."""
    return sum(len(p) // BS // P * P * BS for p in prompts)


def servable_tokens(prompts) -> int:
    """What a hit may serve of each prompt: its whole records' blocks before the last token (one
    is always computed, for its logits)."""
    return sum(min((len(p) - 1) // BS, len(p) // BS // P * P) * BS for p in prompts)


def disk(stats) -> dict:
    return stats["kv_tiers"]["disk"]


def test_a_second_engine_reads_what_the_first_wrote_with_the_same_tokens(model, prompts, tmp_path):
    alone, _, _ = run(model, prompts, None)
    first, s1, _ = run(model, prompts, str(tmp_path))
    second, s2, _ = run(model, prompts, str(tmp_path))
    assert first == alone and second == alone
    assert disk(s1)["hit_tokens"] == 0
    assert disk(s1)["stored_blocks"] * BS == written_tokens(prompts)
    assert disk(s2)["hit_tokens"] == servable_tokens(prompts)
    assert s2["prefill_tokens_computed"] == sum(map(len, prompts)) - servable_tokens(prompts)
    assert disk(s2)["stored_blocks"] == 0, "the second engine rewrites nothing"


def test_a_longer_prompt_reads_the_shared_part_and_computes_the_rest(model, prompts, tmp_path):
    run(model, prompts[:1], str(tmp_path))
    longer = [prompts[0] + prompts[1]]
    alone, _, _ = run(model, longer, None)
    tokens, stats, _ = run(model, longer, str(tmp_path))
    assert tokens == alone
    assert disk(stats)["hit_tokens"] == written_tokens(prompts[:1]) > 0


def test_another_process_reads_the_records(model, prompts, tmp_path):
    """A child process with the same weights (the same seed) writes; this one reads."""
    code = CHILD_ENGINE + (
        f"prompts = {prompts!r}\n"
        "outs = e.generate(prompts, SamplingParams(max_new_tokens=6))\n"
        "e.flush_kv_tiers()\n"
        "print([o.token_ids for o in outs])\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    tokens, stats, _ = run(model, prompts, str(tmp_path))
    assert repr(tokens) == child.stdout.strip().splitlines()[-1]
    assert disk(stats)["hit_tokens"] == servable_tokens(prompts)


def one_key_row_changed(model):
    """A copy of ``model`` whose weights differ in one row of one layer's k_proj only, past its
    first elements (a fingerprint that samples a tensor's start would miss it)."""
    other = copy.deepcopy(model)
    weight = other.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        weight[-1] += 0.5
    return other


@pytest.mark.parametrize(
    "change", ["weights", "one row of one k_proj", "salt", "block size", "namespace"]
)
def test_nothing_is_served_across_what_the_kv_depends_on(model, prompts, tmp_path, change):
    run(model, prompts, str(tmp_path))
    other_model, params, options = model, None, {}
    if change == "weights":
        other_model = make_tiny_model("llama", seed=1).double()
    elif change == "one row of one k_proj":
        other_model = one_key_row_changed(model)
    elif change == "salt":
        params = SamplingParams(max_new_tokens=6, cache_salt="tenant-b")
    elif change == "block size":
        options = {"block_size": 8}
    else:
        options = {"namespace": "another"}
    alone, _, _ = run(other_model, prompts, None, params, **options)
    tokens, stats, _ = run(other_model, prompts, str(tmp_path), params, **options)
    assert tokens == alone
    assert disk(stats)["hit_tokens"] == 0


def test_an_adapter_switch_reads_only_that_adapters_records(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = make_tiny_model("llama").double()
    model = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    prompts = tiny_prompts(base.config.vocab_size, 2, [21, 30], seed=7)
    _, s_on, _ = run(model, prompts, str(tmp_path))
    with model.disable_adapter():
        alone, _, _ = run(model, prompts, None)
        tokens, s_off, _ = run(model, prompts, str(tmp_path))
    assert tokens == alone
    assert disk(s_off)["hit_tokens"] == 0, (
        "KV computed with the adapter never serves the base model"
    )
    _, s_again, _ = run(model, prompts, str(tmp_path))
    assert disk(s_again)["hit_tokens"] == servable_tokens(prompts)


def test_a_damaged_record_is_skipped_with_a_warning_and_recomputed(model, prompts, tmp_path):
    alone, _, _ = run(model, prompts, None)
    run(model, prompts, str(tmp_path))
    records = sorted(tmp_path.rglob("*.kv"))
    assert records
    for path in records[:3]:  # a flipped payload byte in three, a truncation in a fourth
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)
    records[3].write_bytes(records[3].read_bytes()[:50])
    with pytest.warns(RuntimeWarning, match="bad record"):
        tokens, stats, _ = run(model, prompts, str(tmp_path))
    assert tokens == alone
    assert disk(stats)["corrupt"] >= 1  # a chain's read stops at its first bad record
    assert disk(stats)["hit_tokens"] < servable_tokens(prompts)


def test_a_weights_change_in_process_turns_the_tier_off_once(model, prompts, tmp_path, caplog):
    trained = make_tiny_model("llama").double()
    engine = paged_hf.Engine(trained, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path))
    engine.generate(prompts, SamplingParams(max_new_tokens=2))
    with torch.no_grad():
        trained.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        tokens = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=6))]
        with torch.no_grad():
            trained.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    offs = [r for r in caplog.records if "KV cache tiers are off" in r.getMessage()]
    assert len(offs) == 1, "one message"
    fresh = make_tiny_model("llama").double()
    with torch.no_grad():
        fresh.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    expected, _, _ = run(fresh, prompts, None)
    assert tokens == expected
    assert not engine.scheduler.kv_tiers.on and disk(engine.stats())["hit_tokens"] == 0


def test_models_with_state_or_several_cache_groups_keep_the_tier_off(tmp_path, caplog):
    model = make_tiny_model("gemma2").double()  # sliding and full layers: two cache groups
    with caplog.at_level(logging.WARNING, logger="paged_hf"):
        engine = paged_hf.Engine(model, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path))
    assert engine.scheduler.kv_tiers is None
    assert any("kv_cache_dir" in r.getMessage() for r in caplog.records)
    assert engine.stats()["kv_tiers"] == {}


def test_the_directory_comes_from_the_environment(monkeypatch, tmp_path, model):
    monkeypatch.setenv("PAGED_HF_KV_CACHE_DIR", str(tmp_path))
    engine = paged_hf.Engine(model, block_size=BS, num_blocks=64)
    assert engine.scheduler.kv_tiers is not None
    assert (
        paged_hf.Engine(
            model, block_size=BS, num_blocks=64, enable_prefix_caching=False
        ).scheduler.kv_tiers
        is None
    )


def test_smollm2_reads_its_records_with_the_same_tokens(smollm2_fp32, tmp_path):
    """The default model in fp32 (packed CPU weights and all): records written by one engine give
    a second engine the tokens of computing them, and the fingerprint is the same for both."""
    model, tok = smollm2_fp32
    shared = tok("You are a careful assistant. Answer briefly and precisely. " * 4)["input_ids"]
    prompts = [shared + tok(q)["input_ids"] for q in ("What is 2+2?", "Name a colour.")]
    params = SamplingParams(max_new_tokens=8)

    def run_smol(kv_dir):
        engine = paged_hf.Engine(model, tok, block_size=16, num_blocks=64, kv_cache_dir=kv_dir)
        outs = engine.generate(prompts, params)
        engine.flush_kv_tiers()
        return [o.token_ids for o in outs], engine.stats()

    alone, _ = run_smol(None)
    first, _ = run_smol(str(tmp_path))
    second, stats = run_smol(str(tmp_path))
    assert first == alone and second == alone
    served = stats["kv_tiers"]["disk"]["hit_tokens"] + stats["prefix_hit_tokens"]
    assert stats["kv_tiers"]["disk"]["hit_tokens"] > 0
    assert served == sum(min((len(p) - 1) // 16, len(p) // 16) * 16 for p in prompts)


def test_a_load_that_fails_ends_its_steps_requests_alone(model, prompts, tmp_path):
    """Copying read records into the pool fails: the requests of that step end with the error; a
    request waiting beside them (two seats) gets its own tokens; no block leaks, and the engine
    goes on to give the next requests their tokens."""
    alone, _, _ = run(model, prompts, None)
    run(model, prompts[:2], str(tmp_path))
    engine = paged_hf.Engine(
        model, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path), max_num_seqs=2
    )
    tier = engine.scheduler.kv_tiers

    def broken(handles, pages):
        raise OSError("injected: the copy into the pool failed")

    tier.load = broken
    params = SamplingParams(max_new_tokens=6)
    rids = [engine.add_request(p, params) for p in (prompts[0], prompts[1], prompts[4])]
    *failed, bystander = engine.run_until_done(rids)
    assert all(o.finish_reason == "error" and "injected" in o.error for o in failed)
    assert bystander.error is None and bystander.token_ids == alone[4]
    assert_clean(engine)
    del tier.load  # the class's own again
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == alone
    assert_clean(engine)


def test_a_read_may_start_inside_a_record_where_the_index_hit_ends(model, tmp_path):
    """The in-memory index holds the first 5 blocks; the disk tier's record of blocks 4-7 serves
    blocks 5-7 (its first row is skipped), and the tokens are those of computing everything."""
    assert P == 4
    x = tiny_prompts(model.config.vocab_size, 1, 40, seed=11)[0]
    run(model, [x], str(tmp_path))  # records of blocks 0-3 and 4-7
    alone, _, _ = run(model, [x], None)
    engine = paged_hf.Engine(model, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path))
    engine.generate([x[:21]], SamplingParams(max_new_tokens=6))  # the index: blocks 0-4 of x
    hit_before = disk(engine.stats())["hit_tokens"]
    out = engine.generate([x], SamplingParams(max_new_tokens=6))[0]
    assert out.token_ids == alone[0]
    assert engine.stats()["prefix_hit_tokens"] >= 5 * BS
    assert disk(engine.stats())["hit_tokens"] - hit_before == 3 * BS
    assert_clean(engine)


@pytest.mark.parametrize("write", ["eviction", "through"])
def test_blocks_the_pool_evicted_come_back_from_host_memory(model, write):
    """A pool of 24 blocks, three 40-token prompts (10 blocks each): the third evicts the first's
    blocks; asked again, the first prompt reads them from host memory, with its tokens. Written on
    eviction, host memory holds only what the pool let go; written through, every record."""
    prompts = tiny_prompts(model.config.vocab_size, 3, 40, seed=13)
    alone, _, _ = run(model, prompts[:1], None)
    options = dict(block_size=BS, num_blocks=24, kv_host_cache_bytes=64 << 20, max_num_seqs=1)
    engine = paged_hf.Engine(model, kv_host_write=write, **options)
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=6))
    stored = engine.stats()["kv_tiers"]["host"]["stored_blocks"]
    assert stored == (0 if write == "eviction" else written_tokens(prompts[:1]) // BS)
    for p in prompts[1:]:
        engine.generate([p], SamplingParams(max_new_tokens=6))
    stored = engine.stats()["kv_tiers"]["host"]["stored_blocks"]
    if write == "eviction":  # some, not all: the pool still holds the third prompt's
        assert 0 < stored < written_tokens(prompts) // BS
    else:
        assert stored == written_tokens(prompts) // BS
    before = engine.stats()
    again = engine.generate([prompts[0]], SamplingParams(max_new_tokens=6))[0]
    after = engine.stats()
    assert again.token_ids == alone[0]
    host = after["kv_tiers"]["host"]["hit_tokens"] - before["kv_tiers"]["host"]["hit_tokens"]
    from_pool = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert host > 0, "the pool evicted the first prompt's blocks: the host tier serves them"
    assert host + from_pool == servable_tokens(prompts[:1])
    without = paged_hf.Engine(model, **dict(options, kv_host_cache_bytes=None))
    for p in prompts:
        without.generate([p], SamplingParams(max_new_tokens=6))
    hits = without.stats()["prefix_hit_tokens"]
    without.generate([prompts[0]], SamplingParams(max_new_tokens=6))
    assert without.stats()["prefix_hit_tokens"] - hits < host + from_pool, (
        "the pool alone lost them"
    )
    assert_clean(engine)


def test_a_disk_hit_is_kept_in_host_memory(model, prompts, tmp_path):
    run(model, prompts, str(tmp_path))
    tokens, stats, engine = run(model, prompts, str(tmp_path), kv_host_cache_bytes=64 << 20)
    assert stats["kv_tiers"]["disk"]["hit_tokens"] == servable_tokens(prompts)
    assert stats["kv_tiers"]["host"]["records"] == written_tokens(prompts) // (P * BS)
    for path in tmp_path.rglob("*.kv"):  # the disk records gone: host memory still serves
        path.unlink()
    engine.kv_manager.reset_prefix_cache(engine._cache_key())  # the pool's copies gone too
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == tokens
    host = engine.stats()["kv_tiers"]["host"]["hit_tokens"]
    assert host == servable_tokens(prompts)


def test_a_page_freed_without_eviction_is_never_written_as_its_record(model, prompts):
    """Write on eviction copies a record's pages when the pool evicts them; a page freed any other
    way (a request's own copy of a block the index already held) may hold anything next, so the
    record it was part of is forgotten, not copied later."""
    engine = paged_hf.Engine(model, block_size=BS, num_blocks=256, kv_host_cache_bytes=64 << 20)
    tier = engine.scheduler.kv_tiers
    assert engine.kv_manager.pool.listener is tier
    tier._watch(b"k" * 32, [7, 8, 9, 10])
    tier.released(8)
    tier.evicted([10])
    assert not tier.store("host").contains(b"k" * 32) and not tier._watched
    tier._watch(b"j" * 32, [7, 8, 9, 10])
    tier.evicted([10, 9])  # the record's last page among the evicted: copied, once
    assert tier.store("host").contains(b"j" * 32) and tier.stored_blocks["host"] == P
    # and in use: the same tokens as without the tier, nothing left watched that the pool freed
    outs = engine.generate(prompts + prompts[:2], SamplingParams(max_new_tokens=6))
    alone, _, _ = run(model, prompts, None)
    assert [o.token_ids for o in outs[: len(prompts)]] == alone
    pool = engine.kv_manager.pool
    assert all(not pool.is_free(page) for page in tier._record_of)
    assert_clean(engine)


def test_the_host_store_keeps_the_most_recently_used_within_its_bound():
    from paged_hf.cache.host_kv_store import HostKVStore
    from paged_hf.cache.kv_store import KVStore

    store = HostKVStore(max_bytes=4 * 400)
    assert isinstance(store, KVStore)
    record = lambda i: torch.full((100,), float(i))  # noqa: E731 - 400 bytes
    for i in range(4):
        store.put(bytes([i]) * 32, record(i))
    out = torch.empty(100)
    assert store.get_into(bytes([0]) * 32, out) and torch.equal(out, record(0))
    store.put(bytes([4]) * 32, record(4))  # evicts 1, the least recently used
    assert not store.contains(bytes([1]) * 32) and store.contains(bytes([0]) * 32)
    assert store.nbytes <= 4 * 400 and store.stats()["evicted_records"] == 1


def assert_served_in_full(model, prompts, kv_dir) -> None:
    """An engine on ``kv_dir`` reads every servable block of ``prompts``, finds no bad record and
    gives the tokens of computing them (its pool has room: no preemption, no block read twice)."""
    alone, _, _ = run(model, prompts, None, num_blocks=512)
    tokens, stats, _ = run(model, prompts, str(kv_dir), num_blocks=512)
    assert tokens == alone
    assert stats["preemptions"] == 0
    assert disk(stats)["hit_tokens"] == servable_tokens(prompts)
    assert disk(stats)["corrupt"] == 0


def test_an_engine_killed_while_writing_leaves_a_directory_the_next_one_uses(model, tmp_path):
    """SIGKILL a process whose engine writes records (its writer thread mid-write, most likely);
    the next engine on the directory serves what survived and gives the tokens of computing."""
    import signal
    import time

    code = CHILD_ENGINE + (
        "for seed in range(10_000):\n"
        "    prompts = tiny_prompts(model.config.vocab_size, 4, 64, seed=seed)\n"
        "    e.generate(prompts, SamplingParams(max_new_tokens=1))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=CHILD_ENV)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.rglob("*.kv"))) < 40 and time.monotonic() < deadline:
            assert child.poll() is None, "the writer process ended early"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert len(list(tmp_path.rglob("*.kv"))) >= 40
    prompts = tiny_prompts(model.config.vocab_size, 4, 64, seed=0)
    assert_served_in_full(model, prompts, tmp_path)


def test_two_engines_in_two_processes_write_one_directory_at_once(model, tmp_path):
    """Two processes generate overlapping prompt sets on one directory at the same time (the same
    records written twice, racing); a third engine then serves every prompt from it with the
    tokens of computing, and finds no bad record."""
    code = CHILD_ENGINE + (
        "for seed in map(int, sys.argv[2].split(',')):\n"
        "    e.generate(tiny_prompts(model.config.vocab_size, 4, 48, seed=seed),\n"
        "               SamplingParams(max_new_tokens=1))\n"
        "e.flush_kv_tiers()\n"
    )
    children = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path), seeds], env=CHILD_ENV)
        for seeds in ("0,1,2,3", "2,3,4,5")
    ]
    assert [c.wait(timeout=300) for c in children] == [0, 0]
    prompts = [
        p for seed in range(6) for p in tiny_prompts(model.config.vocab_size, 4, 48, seed=seed)
    ]
    assert_served_in_full(model, prompts, tmp_path)


def test_a_read_is_kept_for_the_admission_and_rebound_after_an_adapter_switch(
    model, prompts, tmp_path
):
    """What a lookup found for an admission that found no room is not looked up again at the next
    try; an adapter switch between two tries keys the request under the new state (KV computed with
    one adapter never serves the other). A lookup reads no record: the step's load does."""
    from paged_hf.cache.kv_store import KVStore
    from paged_hf.requests.request import Request

    run(model, prompts[:1], str(tmp_path))
    engine = paged_hf.Engine(model, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path))
    tier = engine.scheduler.kv_tiers
    store = tier.store("disk")
    assert isinstance(store, KVStore)
    asked = []
    store.contains = lambda key, contains=store.contains: asked.append(key) or contains(key)
    req = Request("r", prompts[0], SamplingParams(max_new_tokens=2))
    last = (len(prompts[0]) - 1) // BS
    first = tier.lookup(req, 0, last)
    assert first is not None and first.blocks["disk"] == len(first) > 0
    assert store.stats()["hits"] == 0, "a lookup reads nothing"
    assert tier.lookup(req, 0, last) is first
    assert len(asked) == len(first.keys), "not looked up twice"
    keys = list(req.tier_state.keys)
    tier.follow_adapters(("another adapter state",))
    assert tier.lookup(req, 0, last) is None, "no record under that state"
    assert req.tier_state.keys != keys and req.tier_state.last_match is None


def test_a_record_gone_between_the_lookup_and_the_load_is_computed(model, prompts, tmp_path):
    """The admission's lookup finds the records; another process evicts them before the step reads
    them: the blocks are computed in that step instead, with the tokens of computing everything,
    and are not counted as cached."""
    alone, _, _ = run(model, prompts, None)
    run(model, prompts, str(tmp_path))
    engine = paged_hf.Engine(model, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path))
    tier = engine.scheduler.kv_tiers
    loads = []

    def load_after_eviction(match, pages):
        loads.append(len(match))
        for path in tmp_path.rglob("*.kv"):
            path.unlink()
        return type(tier).load(tier, match, pages)

    tier.load = load_after_eviction
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == alone
    assert sum(loads) * BS == servable_tokens(prompts)
    stats = engine.stats()
    assert disk(stats)["hit_tokens"] == 0 and disk(stats)["misses"] > 0
    assert stats["prefill_tokens_computed"] == sum(map(len, prompts))
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert_clean(engine)


def test_an_engine_woken_up_loads_records_into_its_new_pages(model, prompts, tmp_path):
    """Sleep lets the KV tensors go and waking up makes new ones: the tiers read into the pages of
    the backend there is now, with the tokens of computing everything."""
    alone, _, _ = run(model, prompts, None)
    run(model, prompts, str(tmp_path))
    engine = paged_hf.Engine(model, block_size=BS, num_blocks=256, kv_cache_dir=str(tmp_path))
    engine.sleep()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [o.token_ids for o in outs] == alone
    assert disk(engine.stats())["hit_tokens"] == servable_tokens(prompts)
    assert_clean(engine)
