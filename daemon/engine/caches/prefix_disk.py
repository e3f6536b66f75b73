"""The prefix cache's disk tier: snapshots in files, so they outlive RAM pressure and restarts.

A file holds one snapshot (every layer's state after a token prefix, and the MTP head's
history when it has one). Layout: MAGIC, an 8-byte header length, a JSON header (the
fingerprint, the tokens, each array's dtype/shape/offset), the arrays' raw bytes, and a
32-byte BLAKE2b digest of everything before it. A file whose digest, magic, fingerprint
or tokens do not check out is a miss (logged, deleted), never a restored state: a torn
write, a flipped bit or a file from another model cannot reach the model.

Files live under ``root/<fingerprint>/``: the fingerprint names what changes the numbers a
snapshot holds (the model's content, backend, dtype, mlx and mlx-lm versions, the prefill
chunk and path), so a daemon never even lists another configuration's files. File names
carry what lookup needs without opening them: ``<tokens>-<digest of the tokens>-<h|b>-<x|i>``
(with/without a head history; exact/inexact, see prefix_cache.py).

Threads: the engine thread makes the arrays' bytes readable (``mx.eval`` of contiguous
views; no copy) and hands them to one writer thread, which writes ``<name>.tmp``, fsyncs,
and renames it into place (atomic on POSIX), then enforces the byte budget (oldest first)
and the free-space floor. Reads happen on the engine thread, at a hit. No mlx call runs on
the writer thread: it only reads bytes the engine thread already materialized. Any OSError
(full disk, read-only folder, a vanished file) is logged and makes that write or read a
miss; the daemon keeps serving.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np


MAGIC = b"councild-snapshot\x01"
DIGEST = 32
SUFFIX = ".snap"
# A write that would leave less than this free on the cache's filesystem is skipped: a
# cache must never be what fills the disk the daemon (and its logs) live on.
DEFAULT_MIN_FREE = 1 << 30
# Bytes handed to the writer but not yet written: past this a new write is skipped (the
# snapshot stays in RAM), so a slow disk cannot pin unbounded memory.
MAX_PENDING = 1 << 32

_NP = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "int32": np.int32,
       "uint32": np.uint32, "int64": np.int64, "uint8": np.uint8, "int8": np.int8, "bool": np.bool_,
       "uint16": np.uint16, "int16": np.int16}


def token_digest(tokens) -> str:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.uint32).tobytes(), digest_size=16).hexdigest()


def model_fingerprint(model_path: str | Path, extra: dict) -> str:
    """A short hash of the model's content and of ``extra`` (backend, dtype, versions,
    prefill settings). Content: config.json and the tokenizer in full; each weight file's
    size, safetensors header (tensor names, shapes, offsets) and first and last MiB, a
    sample that changes with any re-quantization or re-upload at a cost of milliseconds
    (hashing every byte of a 50 GB model would take minutes at each start)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(extra, sort_keys=True).encode())
    root = Path(model_path)
    for p in sorted(root.iterdir()) if root.is_dir() else [root]:
        if not p.is_file():
            continue
        h.update(p.name.encode())
        size = p.stat().st_size
        h.update(struct.pack("<Q", size))
        with open(p, "rb") as f:
            if p.suffix in (".json", ".txt", ".jinja", ".model") and size < 64 << 20:
                h.update(f.read())
                continue
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(size - (1 << 20))
                h.update(f.read())
    return h.hexdigest()


def numerics_key(lm, chunk: int) -> dict:
    """What, besides the weights, changes the numbers in a snapshot."""
    import importlib.metadata as md

    try:
        mlx_lm_version = md.version("mlx-lm")
    except md.PackageNotFoundError:
        mlx_lm_version = "?"
    device = mx.default_device()
    backend = ("metal" if mx.metal.is_available() else "cuda") if device == mx.gpu else "cpu"
    try:
        dtype = str(lm.backbone.embed_tokens.weight.dtype)
    except AttributeError:
        dtype = "?"
    # The kernels a forward runs on and the engine's own code change the states' last bits too
    # (``arithmetic_key``): a snapshot from another set would make a hit differ from computing
    # the prefix afresh.
    return {"backend": backend, "dtype": dtype, "mlx": mx.__version__, "mlx_lm": mlx_lm_version,
            "prefill_chunk": chunk, "chunked_prefill": bool(getattr(lm, "chunked_prefill", False)),
            "decode_path": getattr(lm, "decode_path", ""), **lm.arithmetic_key()}


# ---------------------------------------------------------------------- encoding


@dataclass
class Pending:
    """A snapshot's bytes, readable off the engine thread (views, not copies)."""

    name: str
    header: bytes
    views: list  # memoryviews of evaluated contiguous mx arrays, in payload order
    keep: list  # the mx arrays behind the views (alive until written)
    nbytes: int


def _spec(a: mx.array | None, offset: int) -> dict | None:
    if a is None:
        return None
    return {"dtype": str(a.dtype).removeprefix("mlx.core."), "shape": list(a.shape), "offset": offset,
            "nbytes": a.nbytes}


def prepare(fingerprint: str, tokens, base_states: list, head_states: list | None,
            head_hidden: mx.array | None, exact: bool, name: str) -> Pending:
    """On the engine thread: lay out a snapshot's arrays for the writer. ``*_states``: per
    layer, the cache's ``state`` as it is (nested tuples/lists of arrays, None, ints)."""
    arrays, keep = [], []
    offset = 0

    def add(a):
        nonlocal offset
        if a is None:
            return None
        c = mx.contiguous(a)
        if c.dtype == mx.bfloat16:
            c = c.view(mx.uint16)
        spec = _spec(a, offset)
        arrays.append(c)
        offset += a.nbytes
        return spec

    def tree(x):
        if isinstance(x, mx.array):
            return {"a": add(x)}
        if isinstance(x, (list, tuple)):
            return {"tuple" if isinstance(x, tuple) else "list": [tree(v) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        raise TypeError(f"cannot store a {type(x).__name__} in a snapshot")

    header = {"fingerprint": fingerprint, "tokens": list(map(int, tokens)), "exact": exact,
              "base": [tree(st) for st in base_states],
              "head": None if head_states is None else [tree(st) for st in head_states],
              "head_hidden": add(head_hidden), "created": time.time()}
    mx.eval(arrays)
    views = [memoryview(a) for a in arrays]
    keep.extend(arrays)
    return Pending(name, json.dumps(header).encode(), views, keep, offset)


class CorruptSnapshot(Exception):
    pass


def decode(data: bytes, fingerprint: str, tokens) -> dict:
    """Parse and check a snapshot file's bytes; raise CorruptSnapshot (why) unless it is
    whole, this configuration's and holds exactly ``tokens``."""
    if len(data) < len(MAGIC) + 8 + DIGEST or not data.startswith(MAGIC):
        raise CorruptSnapshot("not a snapshot file (bad magic or too short)")
    body, digest = data[:-DIGEST], data[-DIGEST:]
    if hashlib.blake2b(body, digest_size=DIGEST).digest() != digest:
        raise CorruptSnapshot("checksum mismatch (torn or altered file)")
    (hlen,) = struct.unpack("<Q", body[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header = json.loads(body[start : start + hlen])
    if header.get("fingerprint") != fingerprint:
        raise CorruptSnapshot("written for another model or configuration")
    if header.get("tokens") != list(tokens):
        raise CorruptSnapshot("holds other tokens than its name says")
    payload = memoryview(body)[start + hlen :]

    def arr(spec):
        if spec is None:
            return None
        raw = np.frombuffer(payload[spec["offset"] : spec["offset"] + spec["nbytes"]], dtype=_NP[spec["dtype"]])
        a = mx.array(raw.reshape(spec["shape"]))
        return a.view(mx.bfloat16) if spec["dtype"] == "bfloat16" else a

    def tree(node):
        if "a" in node:
            return arr(node["a"])
        if "tuple" in node:
            return tuple(tree(v) for v in node["tuple"])
        if "list" in node:
            return [tree(v) for v in node["list"]]
        return node["v"]

    return {"base": [tree(st) for st in header["base"]],
            "head": None if header["head"] is None else [tree(st) for st in header["head"]],
            "head_hidden": arr(header["head_hidden"]), "exact": bool(header["exact"])}


def file_name(tokens: int, digest: str, head: bool, exact: bool) -> str:
    return f"{tokens}-{digest}-{'h' if head else 'b'}-{'x' if exact else 'i'}{SUFFIX}"


@dataclass
class DiskEntry:
    tokens: int
    digest: str
    head: bool
    exact: bool
    nbytes: int
    used_at: float


def parse_name(name: str) -> tuple[int, str, bool, bool] | None:
    if not name.endswith(SUFFIX):
        return None
    parts = name[: -len(SUFFIX)].split("-")
    if len(parts) != 4 or not parts[0].isdigit() or parts[2] not in "hb" or parts[3] not in "xi":
        return None
    return int(parts[0]), parts[1], parts[2] == "h", parts[3] == "x"


# ---------------------------------------------------------------------- the tier


class DiskTier:
    """The files of one fingerprint under ``root``, an index of them, and the writer."""

    def __init__(self, root: str | Path, fingerprint: str, max_bytes: int, log, ttl_s: float | None = None,
                 min_free_bytes: int = DEFAULT_MIN_FREE):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.dir = self.root / fingerprint
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.min_free_bytes = min_free_bytes
        self.log = log
        self.lock = threading.Lock()  # guards the index and counters (engine + writer threads)
        self.index: dict[tuple[int, str], DiskEntry] = {}
        self.nbytes = 0
        self.hits = self.misses = self.corrupt = self.writes = self.write_failures = self.skipped = 0
        self.evicted = 0
        self.pending_bytes = 0
        self.usable = True
        self._full_logged = False
        self._queue: queue.Queue = queue.Queue()
        self._discarded: set[tuple[int, str]] = set()  # dropped while maybe still queued
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="councild-prefix-disk", daemon=True)
        self._writer.start()

    # -------------------------------------------------------------- index
    def _scan(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            names = list(os.scandir(self.dir))
        except OSError as exc:
            self.usable = False
            self.log.warning("prefix_cache.disk_unusable", path=str(self.dir), error=repr(exc))
            return
        now = time.time()
        for e in names:
            parsed = parse_name(e.name)
            if parsed is None:
                if e.name.endswith(".tmp"):  # a write cut short by a crash
                    self._unlink(Path(e.path))
                continue
            try:
                st = e.stat()
            except OSError:
                continue
            if self.ttl_s is not None and now - st.st_mtime > self.ttl_s:
                self._unlink(Path(e.path))
                continue
            n, digest, head, exact = parsed
            self.index[(n, digest)] = DiskEntry(n, digest, head, exact, st.st_size, st.st_mtime)
            self.nbytes += st.st_size
        self._enforce_budget()
        self.log.info("prefix_cache.disk_opened", path=str(self.dir), files=len(self.index), bytes=self.nbytes,
                      max_bytes=self.max_bytes)

    def lengths(self) -> set[int]:
        with self.lock:
            return {k[0] for k in self.index}

    def find(self, n: int, digest: str) -> DiskEntry | None:
        with self.lock:
            return self.index.get((n, digest))

    def path(self, e: DiskEntry) -> Path:
        return self.dir / file_name(e.tokens, e.digest, e.head, e.exact)

    # -------------------------------------------------------------- reading
    def load(self, e: DiskEntry, tokens) -> dict | None:
        """The snapshot's arrays (see ``decode``), or None: a missing, corrupt or foreign
        file is a miss, logged, and the file is deleted."""
        p = self.path(e)
        try:
            with open(p, "rb") as f:
                data = f.read()
            out = decode(data, self.fingerprint, tokens)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with a file, it is a miss
            with self.lock:
                self.corrupt += 1
            self.log.warning("prefix_cache.disk_corrupt", file=p.name, tokens=e.tokens, error=str(exc))
            self._forget(e, delete=True)
            return None
        with self.lock:
            self.hits += 1
            e.used_at = time.time()
        try:
            os.utime(p)  # recency survives a restart
        except OSError:
            pass
        return out

    # -------------------------------------------------------------- writing
    def submit(self, pending: Pending) -> bool:
        """Queue a write; False (skipped) when over the pending cap or the tier is unusable."""
        if not self.usable or pending.nbytes > self.max_bytes:
            return False
        parsed = parse_name(pending.name)
        with self.lock:
            if self.pending_bytes + pending.nbytes > MAX_PENDING:
                self.skipped += 1
                return False
            self.pending_bytes += pending.nbytes
            self._discarded.discard((parsed[0], parsed[1]))
        self._queue.put(pending)
        return True

    def discard(self, key: tuple[int, str]) -> None:
        """Delete a snapshot's file (and any write of it still queued)."""
        with self.lock:
            self._discarded.add(key)
            e = self.index.get(key)
        if e is not None:
            self._forget(e, delete=True)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(item)
            except Exception as exc:  # noqa: BLE001 - a write never takes the daemon down
                with self.lock:
                    self.write_failures += 1
                self.log.warning("prefix_cache.disk_write_failed", file=item.name, error=repr(exc))
            finally:
                with self.lock:
                    self.pending_bytes -= item.nbytes
                item.views.clear()
                item.keep.clear()

    def _write(self, p: Pending) -> None:
        parsed = parse_name(p.name)
        n, digest, head, exact = parsed
        size = len(MAGIC) + 8 + len(p.header) + p.nbytes + DIGEST
        with self.lock:
            old = self.index.get((n, digest))
            if (n, digest) in self._discarded:
                return
        if old is not None and (old.head or not head) and (old.exact or not exact):
            return  # already on disk, with at least as much
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = 0
        if free - size < self.min_free_bytes:
            with self.lock:
                self.skipped += 1
            if not self._full_logged:
                self._full_logged = True
                self.log.warning("prefix_cache.disk_full", path=str(self.dir), free_bytes=free, needed_bytes=size,
                                 min_free_bytes=self.min_free_bytes)
            return
        self._full_logged = False
        final = self.dir / p.name
        tmp = final.with_name(final.name + ".tmp")
        h = hashlib.blake2b(digest_size=DIGEST)
        try:
            with open(tmp, "wb") as f:
                for chunk in (MAGIC, struct.pack("<Q", len(p.header)), p.header, *p.views):
                    f.write(chunk)
                    h.update(chunk)
                f.write(h.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            self._unlink(tmp)
            raise
        if old is not None:
            self._forget(old, delete=self.path(old) != final)
        with self.lock:
            self.index[(n, digest)] = DiskEntry(n, digest, head, exact, size, time.time())
            self.nbytes += size
            self.writes += 1
        self._enforce_budget()

    # -------------------------------------------------------------- budget
    def _enforce_budget(self) -> None:
        while True:
            with self.lock:
                if self.nbytes <= self.max_bytes or not self.index:
                    return
                oldest = min(self.index.values(), key=lambda e: e.used_at)
                self.evicted += 1
            self._forget(oldest, delete=True)

    def _forget(self, e: DiskEntry, delete: bool) -> None:
        with self.lock:
            if self.index.get((e.tokens, e.digest)) is e:
                del self.index[(e.tokens, e.digest)]
                self.nbytes -= e.nbytes
        if delete:
            self._unlink(self.path(e))

    @staticmethod
    def _unlink(p: Path) -> None:
        try:
            p.unlink()
        except OSError:
            pass

    def stats(self) -> dict:
        with self.lock:
            return {"path": str(self.dir), "files": len(self.index), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "corrupt": self.corrupt, "writes": self.writes,
                    "write_failures": self.write_failures, "skipped": self.skipped, "evicted": self.evicted,
                    "pending_bytes": self.pending_bytes}
