"""The harness's cache folder (``ICR_CACHE``, default ~/.cache/icr-harness) and what it remembers of files'
SHA-256: shared by the engine (a model identified by its files' content) and the trainer (token stores checked
whole)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from harness.files import write_atomic
from harness.hashing import file_digest

log = logging.getLogger("harness")

RACY_SECONDS = 2.0  # a file modified this recently may change again within the clock's resolution: not cached


def cache_dir() -> Path:
    return Path(os.environ.get("ICR_CACHE", Path.home() / ".cache" / "icr-harness"))


class FileHashCache:
    """SHA-256 of files, remembered by (path, size, mtime, ctime, inode, device): any rewrite, copy or ``touch``
    changes one of them. Shared by concurrent runs through a file lock; a lost update only costs a re-hash."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "file-sha256.json"
        self._entries: dict | None = None

    def _load(self) -> dict:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    @staticmethod
    def _stamp(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]

    def sha256(self, file: Path) -> str:
        file = Path(file).resolve()
        st = file.stat()
        key, stamp = str(file), self._stamp(st)
        hit = self._load().get(key)
        if hit is not None and hit[:-1] == stamp:
            return hit[-1]
        t0 = time.perf_counter()
        sha = file_digest(file)
        if st.st_size > 1 << 28:
            log.info("hashed %s (%.1f GB) in %.1f s; cached until the file changes", file, st.st_size / 1e9,
                     time.perf_counter() - t0)
        if self._stamp(file.stat()) == stamp and time.time() - st.st_mtime > RACY_SECONDS:
            self._store(key, [*stamp, sha])
        return sha

    def _store(self, key: str, value: list) -> None:
        from filelock import FileLock

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=10):
                self._entries = None  # merge with what other runs wrote meanwhile
                entries = self._load()
                entries[key] = value
                if len(entries) > 5000:  # forget files that are gone
                    for gone in [k for k in entries if not os.path.exists(k)]:
                        del entries[gone]
                write_atomic(self.path, json.dumps(entries))
        except Exception as e:  # noqa: BLE001  a cache that cannot be written only costs time
            log.debug("file-hash cache not written (%s)", e)
