"""The harness's cache folder (``ICR_CACHE``, default ~/.cache/icr-harness) and what it remembers there: files'
SHA-256, shared by the engine (a model identified by its files' content) and the trainer (token stores checked
whole), and the choices a machine measured once (``MachineChoices``)."""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from harness.files import write_atomic
from harness.hashing import file_digest

log = logging.getLogger("harness")

RACY_SECONDS = 2.0  # a file modified this recently may change again within the clock's resolution: not cached
BUSY_SHARE = 0.25  # other processes took more of the cores' time than this while a measurement ran: a busy machine


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


class OthersBusy:
    """The share of the machine's CPU time that processes other than this one took while the block ran (``share``,
    0 to 1; None where the system's CPU times cannot be read): a speed measured beside them is this process's
    at that moment, not the machine's. psutil reads the system's and the process's times (/proc/stat on Linux)."""

    share: float | None = None

    def __enter__(self) -> "OthersBusy":
        self._start = self._times()
        return self

    def __exit__(self, *exc) -> None:
        end = self._times()
        if self._start is not None and end is not None:
            wall, busy, own = (b - a for a, b in zip(self._start, end))
            cores = psutil.cpu_count() or 1
            self.share = min(1.0, max(0.0, busy - own) / max(wall * cores, 1e-9))

    @staticmethod
    def _times() -> tuple[float, float, float] | None:
        """(wall seconds, the cores' busy seconds, this process's CPU seconds)."""
        try:
            cpu, own = psutil.cpu_times(), psutil.Process().cpu_times()
        except (OSError, psutil.Error):
            return None
        # guest time is counted in user time already; idle and waiting for I/O are not busy
        busy = sum(v for k, v in cpu._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))
        return time.monotonic(), busy, own.user + own.system


def machine_key() -> str:
    """The CPU a measured choice holds for: the processor, the torch build (its BLAS and oneDNN) and the threads a
    call uses."""
    import torch  # lazy: the cache folder's other users (file hashes) need no torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


class MachineChoices:
    """Choices this machine measured once (the Triton scan's tiles, the CPU's linear kernel, the CPU flash kernel's
    race against SDPA, the planner's cost models), kept in the cache folder as one JSON object by key. Written
    behind a file lock and merged with what other processes wrote meanwhile; for a key the first choice written
    stands, so every process on the machine takes the same one and its runs stay reproducible bit for bit."""

    def __init__(self, name: str, what: str):
        self.name, self.what = name, what  # the file's name; what it holds, for messages

    @property
    def file(self) -> Path:
        return cache_dir() / self.name

    def read(self) -> dict:
        """The choices on disk ({} where there are none or the file cannot be read: measured again)."""
        try:
            choices = json.loads(self.file.read_text())
            if not isinstance(choices, dict):
                raise ValueError(f"a JSON {type(choices).__name__}, not an object")
            return choices
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s cannot be read (%s): %s are measured again and the file rewritten", self.file, e,
                        self.what)
            return {}

    def remember(self, key: str, choice: dict, usable: Callable[[Any], bool]) -> dict:
        """Adds ``choice`` under ``key``; returns the one that stands: a ``usable`` choice another process
        remembered first, else this one."""
        from filelock import FileLock  # lazy: only a measurement writes

        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.file) + ".lock", timeout=30):
                choices = self.read()
                if usable(choices.get(key)):
                    choice = choices[key]
                choices[key] = choice
                write_atomic(self.file, json.dumps(choices, indent=1, sort_keys=True))
        except OSError as e:  # a cache that cannot be written costs a measurement a process, not a run
            log.warning("%s could not be remembered in %s (%s)", self.what, self.file, e)
        return choice

    def recall(self, key: str, measure: Callable[[], dict], usable: Callable[[Any], bool],
               quiet_only: bool = False) -> dict:
        """The ``usable`` choice remembered under ``key``, else ``measure()``'s, remembered (``remember``).
        ``quiet_only``, for a choice that changes no output (the planner's cost model): one measured while other
        processes kept the cores busy serves this process and is not remembered, since the machine's first choice
        stands for every later run. A choice that changes a run's numbers is remembered however it was measured:
        every process on the machine must take the same one."""
        choice = self.read().get(key)
        if usable(choice):
            return choice
        if not quiet_only:
            return self.remember(key, measure(), usable)
        with OthersBusy() as busy:
            choice = measure()
        if busy.share is not None and busy.share > BUSY_SHARE:
            log.info("%s was measured while other processes took %.0f%% of the cores: it serves this process and "
                     "is not remembered for the machine (a run on quiet cores measures it again)", self.what,
                     100 * busy.share)
            return choice
        return self.remember(key, choice, usable)

    def forget(self, which: Callable[[str], bool]) -> None:
        """Drops the choices whose keys ``which`` accepts (measured again by the next process that asks)."""
        from filelock import FileLock  # lazy: only a forced measurement writes

        if not self.file.exists():
            return
        try:
            with FileLock(str(self.file) + ".lock", timeout=30):
                choices = self.read()
                if any(which(k) for k in choices):
                    write_atomic(self.file, json.dumps({k: v for k, v in choices.items() if not which(k)},
                                                       indent=1, sort_keys=True))
        except OSError as e:
            log.warning("%s could not be forgotten in %s (%s)", self.what, self.file, e)
