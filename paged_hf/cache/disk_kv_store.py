"""Persistent store of KV-cache block records on local disk, shared by several processes.

Owns the record format (one ``v1/<xx>/<64 hex>.kv`` file per 32-byte key: magic, key, payload
length and crc32, then the payload bytes), the background writer that publishes records
atomically (temp file + ``os.replace``), the byte bound (LRU by mtime over every process's
records) and the cleanup of temp files left by dead writers. Readers never take locks.
"""

from __future__ import annotations

import os
import queue
import secrets
import struct
import threading
import time
import warnings
import weakref
import zlib
from contextlib import suppress
from typing import BinaryIO

import torch

MAGIC = b"PHFKV1\0\0"
HEADER = struct.Struct("<8s32sQI")  # magic, key, payload length, crc32 of the payload
KEY_BYTES = 32
TMP_MAX_AGE_S = 3600.0  # a temp file this old is abandoned even if its pid is alive (pid reuse)
RESCAN_S = 60.0  # other processes write too: refresh the running total at least this often
EXIT_FLUSH_S = 30.0
WRITER_NICE = 10  # the step's threads first: records are written in the time they leave  # at interpreter exit, wait this long at most for queued writes
STAT_NAMES = (
    "hits", "misses", "corrupt", "bytes_read", "bytes_written", "records_written",
    "dropped", "evicted_records", "evicted_bytes", "write_errors",
)  # fmt: skip
_BOUND = object()  # queue marker: rescan and enforce the byte bound (sent by flush)
_STOP = object()


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (numpy has no bfloat16: go via uint8)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _read_record(f: BinaryIO, key: bytes, out: torch.Tensor) -> str | None:
    """Read the record open in ``f`` into ``out``; what is wrong with it, or None when good."""
    # on a regular file a read comes back short only at the end of the file
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return "truncated header"
    magic, stored_key, length, crc = HEADER.unpack(head)
    if magic != MAGIC:
        return f"bad magic {magic!r}"
    if stored_key != key:
        return f"header holds another key {stored_key.hex()}"
    if length != out.nbytes:
        return f"payload is {length} bytes, the caller expects {out.nbytes}"
    size = os.fstat(f.fileno()).st_size
    if size != HEADER.size + length:
        return f"file is {size} bytes, its header says {HEADER.size + length}"
    data = _byte_view(out)
    if f.readinto(data) != length:
        return "truncated payload"
    if zlib.crc32(data) != crc:
        return "crc32 mismatch"
    return None


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        pass
    return False


def _clean_temps(tmp_dir: str) -> None:
    """Remove temp files of dead writers (the pid leads the name) and any older than an hour."""
    now = time.time()
    with os.scandir(tmp_dir) as it:
        for entry in it:
            head = entry.name.split(".", 1)[0]
            pid = int(head) if head.isdigit() else 0
            with suppress(OSError):
                dead = pid > 0 and pid != os.getpid() and _dead(pid)
                if dead or now - entry.stat().st_mtime > TMP_MAX_AGE_S:
                    os.unlink(entry.path)


class _Writer:
    """What the writer thread needs, kept apart from DiskKVStore: the thread must not hold the
    store alive, so that a store that is garbage collected still gets its queue written."""

    def __init__(self, root: str, max_bytes: int, max_pending: int, fsync: bool) -> None:
        self.root, self.max_bytes, self.max_pending = root, max_bytes, max_pending
        self.fsync = fsync
        self.tmp_dir = os.path.join(root, "tmp")
        for d in [self.tmp_dir] + [os.path.join(root, f"{i:02x}") for i in range(256)]:
            os.makedirs(d, exist_ok=True)
        _clean_temps(self.tmp_dir)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.pending: dict[bytes, torch.Tensor] = {}  # key -> the clone put() queued
        self.pending_bytes = 0
        self.outstanding = 0  # queue items not yet processed: flush waits for 0
        self.counts = dict.fromkeys(STAT_NAMES, 0)
        self.warned: set[str] = set()
        self.closed = False
        self.total = sum(size for _, size, _ in self._scan())  # writer thread only from here on
        self.scanned_at = time.monotonic()
        self.dirty = False  # wrote since the last scan: flush must rescan to enforce the bound
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="DiskKVStore-writer", daemon=True)
        self.thread.start()

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + ".kv")

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, n in deltas.items():
                self.counts[name] += n

    def warn_once(self, what: str, err: BaseException) -> None:
        tag = f"{what}:{type(err).__name__}:{getattr(err, 'errno', None)}"
        if tag not in self.warned:
            self.warned.add(tag)
            with suppress(Warning):  # a filter that turns warnings into errors must not kill us
                warnings.warn(f"DiskKVStore {self.root}: {what}: {err}", RuntimeWarning, 2)

    def _run(self) -> None:
        with suppress(OSError, AttributeError):  # Linux: a thread has its own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            while (item := self.queue.get()) is not _STOP:
                self._process(item)
        finally:  # stopped, or killed by a BaseException: never leave flush() waiting
            with self.lock:
                self.closed = True
                self.pending.clear()
                self.pending_bytes = self.outstanding = 0
                self.idle.notify_all()

    def _process(self, item: object) -> None:
        try:
            if item is _BOUND:
                if self.dirty:
                    self._make_room(0, force=True)
            else:
                self._write(item, self.pending[item])
        except Exception as e:  # disk full, permissions, ...: drop the record, keep running
            self.count(write_errors=1)
            self.warn_once("write failed, record dropped", e)
        finally:
            with self.lock:
                if item is not _BOUND:
                    self.pending_bytes -= self.pending.pop(item).nbytes
                self.outstanding -= 1
                self.idle.notify_all()

    def _write(self, key: bytes, payload: torch.Tensor) -> None:
        path = self.path(key)
        if os.path.exists(path):  # another process wrote it since put() looked
            return
        data = _byte_view(payload)
        header = HEADER.pack(MAGIC, key, len(data), zlib.crc32(data))
        self._make_room(len(header) + len(data))
        name = f"{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(4)}.tmp"
        tmp = os.path.join(self.tmp_dir, name)
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # readers see the whole record or none; the last writer wins
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
        self.total += len(header) + len(data)
        self.dirty = True
        self.count(bytes_written=len(data), records_written=1)

    def _scan(self) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of every record on disk, whoever wrote it."""
        records = []
        for i in range(256):
            with suppress(FileNotFoundError), os.scandir(os.path.join(self.root, f"{i:02x}")) as it:
                for e in it:
                    if e.name.endswith(".kv"):
                        with suppress(FileNotFoundError):
                            st = e.stat()
                            records.append((st.st_mtime_ns, st.st_size, e.path))
        return records

    def _make_room(self, need: int, force: bool = False) -> None:
        """Evict least recently used records so that ``need`` more bytes fit under max_bytes.

        The running total misses other processes' writes, so evict only after a rescan, and
        down to 90% of the bound so that the next writes do not rescan at once."""
        fresh = time.monotonic() - self.scanned_at < RESCAN_S
        if not force and fresh and self.total + need <= self.max_bytes:
            return
        records = self._scan()
        self.total = sum(size for _, size, _ in records)
        self.scanned_at, self.dirty = time.monotonic(), False
        if self.total + need <= self.max_bytes:
            return
        target = 0.9 * self.max_bytes - need
        for _, size, path in sorted(records):
            if self.total <= target:
                break
            try:
                os.unlink(path)
                self.count(evicted_records=1, evicted_bytes=size)
            except FileNotFoundError:  # another process evicted it first
                pass
            except OSError as e:
                self.warn_once("eviction failed", e)
                continue
            self.total -= size

    def flush(self, timeout: float | None) -> None:
        with self.lock:
            if not self.thread.is_alive():  # closed, or a forked child that has no writer
                return
            self.outstanding += 1
            self.queue.put(_BOUND)
            if not self.idle.wait_for(lambda: self.outstanding == 0, timeout):
                raise TimeoutError(f"DiskKVStore {self.root}: writes still queued after {timeout}s")

    def close(self, timeout: float | None = None) -> None:
        with self.lock:
            if self.closed:
                return
        try:
            self.flush(timeout)
        except TimeoutError as e:
            warnings.warn(f"{e}; they are lost", RuntimeWarning, stacklevel=2)
        with self.lock:
            self.closed = True
            self.queue.put(_STOP)
        self.thread.join(timeout)


class DiskKVStore:
    """A directory of KV block records keyed by 32-byte digests (the key already says which
    model, geometry, salt and tokens; the store never interprets it). ``get_into`` reads a
    record straight into a caller's tensor; ``put`` queues a copy for the background writer. A
    ``KVStore`` (paged_hf/cache/kv_store.py)."""

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        *,
        max_pending_bytes: int = 256 << 20,
        fsync: bool = False,
    ) -> None:
        if max_bytes <= 0 or max_pending_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}, max_pending_bytes={max_pending_bytes}")
        self.root = os.path.join(os.fspath(directory), "v1")
        self._w = _Writer(self.root, int(max_bytes), int(max_pending_bytes), fsync)
        # at exit or when collected: write what is queued (the callback must not hold self)
        self._finalizer = weakref.finalize(self, self._w.close, EXIT_FLUSH_S)

    def get_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Read ``key``'s payload into ``out`` (contiguous, CPU, the payload's byte size); True
        on a good hit. On False, ``out`` may have been partly overwritten. A bad record (short,
        bad crc, another key, or a size other than ``out``'s: the key fixes the geometry, so a
        size mismatch means the record is wrong) is warned about, deleted and a miss."""
        _check_key(key)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("get_into needs a contiguous CPU tensor")
        w = self._w
        queued = w.pending.get(key)
        if queued is not None and queued.nbytes == out.nbytes:  # queued here, not yet on disk
            _byte_view(out)[:] = _byte_view(queued)
            w.count(hits=1)
            return True
        path = w.path(key)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            w.count(misses=1)
            return False
        with f:
            ino = os.fstat(f.fileno()).st_ino
            try:
                problem = _read_record(f, key, out)
            except OSError as e:
                problem = f"read failed: {e}"
            if problem is None:
                with suppress(OSError):  # LRU by mtime: a hit keeps the record young
                    os.utime(f.fileno() if os.utime in os.supports_fd else path)
                w.count(hits=1, bytes_read=out.nbytes)
                return True
        warnings.warn(f"DiskKVStore: deleting bad record {path}: {problem}", RuntimeWarning, 2)
        with suppress(OSError):
            if os.stat(path).st_ino == ino:  # not a good record another process just put there
                os.unlink(path)
        w.count(corrupt=1, misses=1)
        return False

    def contains(self, key: bytes) -> bool:
        """On disk (any process's) or queued by this one; the record may still turn out bad."""
        _check_key(key)
        return key in self._w.pending or os.path.exists(self._w.path(key))

    def put(self, key: bytes, payload: torch.Tensor, owned: bool = False) -> None:
        """Queue a copy of ``payload`` (any device, dtype, layout) for writing and return at
        once; ``owned``: the caller hands over a contiguous CPU tensor nobody writes again, queued
        as it is. Already stored or queued: nothing to do. Dropped (counted) when the record alone
        exceeds max_bytes, when the queue would exceed max_pending_bytes, or after close()."""
        _check_key(key)
        w = self._w
        nbytes = payload.nbytes
        if HEADER.size + nbytes > w.max_bytes:
            w.count(dropped=1)
            return
        if self.contains(key):
            return
        with w.lock:
            if key in w.pending:
                return
            if w.closed or w.pending_bytes + nbytes > w.max_pending or not w.thread.is_alive():
                w.counts["dropped"] += 1
                return
            # else the caller's tensor may view a pool page that is about to be reused: copy it now
            w.pending[key] = (
                payload.detach()
                if owned and payload.device.type == "cpu" and payload.is_contiguous()
                else torch.empty(payload.shape, dtype=payload.dtype).copy_(payload.detach())
            )
            w.pending_bytes += nbytes
            w.outstanding += 1
            w.queue.put(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued put is written (or dropped on an error), then enforce the byte
        bound over the whole directory; raises TimeoutError if ``timeout`` seconds pass first."""
        self._w.flush(timeout)

    def close(self) -> None:
        """Flush and stop the writer; idempotent. Later puts are dropped."""
        self._finalizer.detach()
        self._w.close()

    def stats(self) -> dict[str, int]:
        """Counters of this store object (misses include corrupt records; bytes_read and
        bytes_written count payload bytes, evicted_bytes whole files)."""
        with self._w.lock:
            return dict(self._w.counts)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes (a sha256 digest), got {key!r}")
