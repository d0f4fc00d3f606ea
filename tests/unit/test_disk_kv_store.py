"""DiskKVStore: round trips, other processes, corrupt and killed writes, the byte bound, errors."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from paged_hf.cache import disk_kv_store
from paged_hf.cache.disk_kv_store import HEADER, DiskKVStore


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def payload_of(i: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Deterministic in ``i``: another process builds the same bytes."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(i)).to(dtype)


# A child loads the module by path: importing the paged_hf package would cost seconds.
CHILD_PRELUDE = (
    "import hashlib, importlib.util, json, os, sys, time\n"
    "import torch\n"
    f"spec = importlib.util.spec_from_file_location('dks', {disk_kv_store.__file__!r})\n"
    "dks = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(dks)\n" + inspect.getsource(key_of) + inspect.getsource(payload_of)
)


def child(code: str, *args: object) -> subprocess.Popen:
    argv = [sys.executable, "-c", CHILD_PRELUDE + code, *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return out


@pytest.fixture
def kv_dir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def open_store(kv_dir: Path):
    stores: list[DiskKVStore] = []

    def make(max_bytes: int = 1 << 30, **kw) -> DiskKVStore:
        stores.append(DiskKVStore(kv_dir, max_bytes, **kw))
        return stores[-1]

    yield make
    for s in stores:
        s.close()


def record_path(kv_dir: Path, i: int) -> Path:
    h = key_of(i).hex()
    return kv_dir / "v1" / h[:2] / f"{h}.kv"


def kv_files(kv_dir: Path) -> list[Path]:
    return list((kv_dir / "v1").glob("*/*.kv"))


def disk_total(kv_dir: Path) -> int:
    return sum(p.stat().st_size for p in kv_files(kv_dir))


def reads_back(store: DiskKVStore, i: int, numel: int, dtype: torch.dtype = torch.float32) -> bool:
    out = torch.empty(numel, dtype=dtype)
    return store.get_into(key_of(i), out) and torch.equal(out, payload_of(i, numel, dtype))


def test_round_trip_float32_and_bfloat16(open_store, kv_dir):
    store = open_store()
    written = 0
    for i, dtype in enumerate([torch.float32, torch.bfloat16]):
        block = payload_of(i, 2 * 4 * 16 * 8, dtype).reshape(2, 4, 16, 8)  # [k/v, heads, pos, dim]
        expected = block.clone()
        store.put(key_of(i), block)
        block.zero_()  # the caller's page is reused at once: the store must have copied it
        store.flush()
        assert record_path(kv_dir, i).stat().st_size == HEADER.size + expected.nbytes
        out = torch.empty_like(expected)
        assert store.get_into(key_of(i), out)
        assert out.dtype == dtype and torch.equal(out, expected)
        written += expected.nbytes
    store.put(key_of(0), payload_of(0, 2 * 4 * 16 * 8).reshape(2, 4, 16, 8))  # already stored
    store.flush()
    assert not store.get_into(key_of(7), torch.empty(16))
    assert store.contains(key_of(0)) and not store.contains(key_of(7))
    s = store.stats()
    assert (s["hits"], s["misses"], s["corrupt"], s["records_written"]) == (2, 1, 0, 2)
    assert s["bytes_written"] == s["bytes_read"] == written
    assert s["dropped"] == s["write_errors"] == s["evicted_records"] == 0


def test_second_store_on_the_directory_reads_the_records(open_store):
    first = open_store()
    for i in range(5):
        first.put(key_of(i), payload_of(i, 1000))
    first.flush()
    second = open_store()
    assert all(reads_back(second, i, 1000) for i in range(5))
    assert second.stats()["hits"] == 5 and first.stats()["hits"] == 0


def test_records_of_another_process_read_back(open_store, kv_dir):
    # the second half is still queued when the child exits: the exit hook must write it
    code = (
        "s = dks.DiskKVStore(sys.argv[1], 1 << 30)\n"
        "for i in range(20):\n"
        "    s.put(key_of(i), payload_of(i, 3000, torch.bfloat16))\n"
        "    if i == 9: s.flush()\n"
    )
    finish(child(code, kv_dir))
    store = open_store()
    assert all(reads_back(store, i, 3000, torch.bfloat16) for i in range(20))
    assert not list((kv_dir / "v1" / "tmp").iterdir())


def flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER.size + 5] ^= 0x40
    path.write_bytes(data)


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def put_other_key_in_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = key_of(99)
    path.write_bytes(data)


@pytest.mark.parametrize(
    "damage, problem",
    [
        (flip_payload_byte, "crc32 mismatch"),
        (cut_in_half, "truncated|file is"),
        (put_other_key_in_header, "another key"),
    ],
)
def test_a_bad_record_is_warned_deleted_and_rewritten(open_store, kv_dir, damage, problem):
    store = open_store()
    store.put(key_of(1), payload_of(1, 4096))
    store.flush()
    path = record_path(kv_dir, 1)
    damage(path)
    with pytest.warns(RuntimeWarning, match=f"{path.name}.*({problem})"):
        assert not reads_back(store, 1, 4096)
    assert not path.exists() and not store.contains(key_of(1))
    assert (store.stats()["corrupt"], store.stats()["misses"]) == (1, 1)
    store.put(key_of(1), payload_of(1, 4096))
    store.flush()
    assert reads_back(store, 1, 4096)


def test_a_size_other_than_the_records_is_a_bad_record(open_store, kv_dir):
    # the key fixes the block geometry, so a record of another size is wrong: it is deleted
    store = open_store()
    store.put(key_of(1), payload_of(1, 64))
    store.flush()
    with pytest.warns(RuntimeWarning, match="256 bytes, the caller expects 512"):
        assert not store.get_into(key_of(1), torch.empty(128))
    assert not record_path(kv_dir, 1).exists()


def test_a_writer_killed_mid_write_leaves_only_good_records(open_store, kv_dir):
    numel = 1 << 18  # 1 MiB of float32
    code = (
        "s = dks.DiskKVStore(sys.argv[1], 1 << 30, max_pending_bytes=8 << 20)\n"
        "for i in range(200):\n"
        "    s.put(key_of(i), payload_of(i, 1 << 18))\n"
        "    if i % 4 == 3: s.flush()\n"
    )
    p = child(code, kv_dir)
    tmp_dir = kv_dir / "v1" / "tmp"
    deadline = time.monotonic() + 60
    # kill while a record is being written: some are done and a temp file is open
    while p.poll() is None and time.monotonic() < deadline:
        if len(kv_files(kv_dir)) >= 5 and os.listdir(tmp_dir):
            break
    assert p.poll() is None, "the child wrote every record before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL
    (tmp_dir / f"{p.pid}.1.00000000.tmp").write_bytes(b"half a rec")  # in case none was left
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = open_store()
        present = [i for i in range(200) if record_path(kv_dir, i).exists()]
        assert 5 <= len(present) < 200
        assert all(reads_back(store, i, numel) for i in present)
    assert not [t for t in tmp_dir.iterdir() if t.name.startswith(f"{p.pid}.")]
    assert len(kv_files(kv_dir)) == len(present)


def test_open_removes_temp_files_of_dead_and_old_writers(open_store, kv_dir):
    open_store().close()
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp_dir = kv_dir / "v1" / "tmp"
    live = tmp_dir / f"{os.getpid()}.1.aaaaaaaa.tmp"  # a writer of this process, still writing
    old = tmp_dir / f"{os.getpid()}.1.bbbbbbbb.tmp"
    orphan = tmp_dir / f"{dead.pid}.1.cccccccc.tmp"
    for t in (live, old, orphan):
        t.write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    open_store()
    assert sorted(tmp_dir.iterdir()) == [live]


def test_two_processes_write_one_directory_at_once(open_store, kv_dir, tmp_path):
    numel, max_bytes = 1 << 14, 2 << 20  # 64 KiB records; each child writes ~3.9 MiB
    code = (
        "first, go = int(sys.argv[2]), sys.argv[3]\n"
        "s = dks.DiskKVStore(sys.argv[1], %d)\n"
        "blocks = [(key_of(i), payload_of(i, %d)) for i in range(first, first + 60)]\n"
        "open(go + '.ready' + str(first), 'w').close()\n"
        "while not os.path.exists(go): time.sleep(0.001)\n"
        "for k, b in blocks: s.put(k, b)\n"
        "s.flush()\n"
        "print(json.dumps(s.stats()))\n"
    ) % (max_bytes, numel)
    go = tmp_path / "go"
    procs = [child(code, kv_dir, first, go) for first in (0, 30)]  # keys 30..59 in both
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.ready{f}").exists() for f in (0, 30)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.005)
    go.touch()
    stats = [json.loads(finish(p)) for p in procs]
    assert sum(s["evicted_records"] for s in stats) > 0
    assert disk_total(kv_dir) <= max_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = open_store(max_bytes)
        present = [i for i in range(90) if record_path(kv_dir, i).exists()]
        assert len(present) >= 10
        assert all(reads_back(store, i, numel) for i in present)


def test_flush_enforces_the_bound_over_other_writers_records(open_store, kv_dir):
    numel = 4096
    max_bytes = 20 * (HEADER.size + 4 * numel)
    first, second = open_store(max_bytes), open_store(max_bytes)  # both see an empty directory
    for store, keys in ((first, range(15)), (second, range(15, 30))):
        for i in keys:
            store.put(key_of(i), payload_of(i, numel))
        store.flush()
    # each running total says 15 records; a rescan at flush finds 30 and evicts
    assert disk_total(kv_dir) <= max_bytes
    assert second.stats()["evicted_records"] > 0 and first.stats()["evicted_records"] == 0


def test_the_byte_bound_evicts_the_least_recently_used(open_store, kv_dir):
    numel = 4096
    record = HEADER.size + 4 * numel
    max_bytes = 20 * record
    store = open_store(max_bytes)
    for i in range(60):  # 3x max_bytes
        store.put(key_of(i), payload_of(i, numel))
        store.flush()
        if i % 5 == 0:
            assert reads_back(store, 0, numel)  # record 0 is used again and again
        time.sleep(0.012)  # file times tick with the kernel's coarse clock
    assert disk_total(kv_dir) <= max_bytes
    present = {i for i in range(60) if record_path(kv_dir, i).exists()}
    assert 0 in present and 1 not in present
    assert set(range(50, 60)) <= present
    assert store.stats()["evicted_records"] == 60 - len(present)
    store.put(key_of(99), payload_of(99, 6 * numel * 4))  # bigger than the whole bound
    store.flush()
    assert store.stats()["dropped"] == 1 and not record_path(kv_dir, 99).exists()


def test_put_returns_at_once_and_drops_beyond_max_pending(open_store, kv_dir, monkeypatch):
    release = threading.Event()
    write = disk_kv_store._Writer._write

    def slow_write(self, key, payload):
        release.wait(30)
        write(self, key, payload)

    monkeypatch.setattr(disk_kv_store._Writer, "_write", slow_write)
    numel = 1 << 16  # 256 KiB
    store = open_store(max_pending_bytes=4 * 4 * numel)
    start = time.monotonic()
    for i in range(10):
        store.put(key_of(i), payload_of(i, numel))
    assert time.monotonic() - start < 2.0
    assert store.stats()["dropped"] == 6
    assert all(store.contains(key_of(i)) for i in range(4))
    assert not any(store.contains(key_of(i)) for i in range(4, 10))
    assert reads_back(store, 2, numel)  # served from the queue before it is on disk
    assert not kv_files(kv_dir)
    release.set()
    store.flush(timeout=30)
    assert store.stats()["records_written"] == 4
    assert {i for i in range(10) if record_path(kv_dir, i).exists()} == set(range(4))


def test_a_write_error_is_counted_warned_and_the_writer_goes_on(open_store, kv_dir, monkeypatch):
    replace, failures = os.replace, []

    def full_disk_once(src, dst):
        if not failures:
            failures.append(dst)
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(disk_kv_store.os, "replace", full_disk_once)
    store = open_store()
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        store.put(key_of(0), payload_of(0, 512))
        store.flush(timeout=30)
    assert store.stats()["write_errors"] == 1 and not store.contains(key_of(0))
    assert not list((kv_dir / "v1" / "tmp").iterdir())
    for i in range(3):
        store.put(key_of(i), payload_of(i, 512))
    store.flush(timeout=30)
    assert all(reads_back(store, i, 512) for i in range(3))
    assert store.stats()["records_written"] == 3


def test_close_is_idempotent_and_later_puts_are_dropped(open_store, kv_dir):
    store = open_store()
    store.put(key_of(0), payload_of(0, 64))
    store.close()
    store.close()
    assert record_path(kv_dir, 0).exists()  # close wrote what was queued
    store.put(key_of(1), payload_of(1, 64))
    store.flush(timeout=5)
    assert store.stats()["dropped"] == 1 and not store.contains(key_of(1))
