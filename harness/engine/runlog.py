"""A run directory's integrity: one writer at a time, a resume log that never loses a finished row, and
outputs replaced atomically.

  .lock / .lock.json   held by the run writing the directory (who: pid, host, start time)
  run.json             the resolved settings the rows were made with; written once a run has been validated
  samples.jsonl        one JSON line per finished instance, appended and fsync'd batch by batch
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

from filelock import FileLock, Timeout

from harness.files import remove_stale_temps, write_atomic

log = logging.getLogger("harness")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message names the directory, the cause and the fix."""


class ResumeMismatchError(RunDirError):
    pass


class RunLockedError(RunDirError):
    pass


class RunLock:
    """An exclusive lock on a run directory for as long as a run writes to it.

    ``filelock`` takes an OS lock (flock), which the kernel drops when its holder dies however it dies, so a
    lock left by a killed run is simply taken over. Who holds it lives in a side file, because filelock
    truncates the lock file itself when it opens it. A lock on a directory that another process deleted or
    replaced guards nothing, so the directory's identity (device, inode) is taken with the lock and
    ``verify`` proves it unchanged before anything is counted. A directory the lock created is removed again
    when the run leaves nothing in it (a start that failed leaves no trace)."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.info = self.dir / ".lock.json"
        self._lock = FileLock(str(self.dir / ".lock"))
        self._identity: tuple = (None, None)  # (directory, lock file) as (device, inode)
        self._created: list[Path] = []

    def acquire(self) -> "RunLock":
        self._created = [p for p in [self.dir, *self.dir.parents] if not p.exists()][::-1]
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise RunLockedError(f"{self.dir} is in use by another run ({self._holder()}); wait for it to finish, "
                                 "or pass another --output") from None
        if self.info.exists():
            log.warning("%s: took over the lock of a run that ended without releasing it (%s)", self.dir,
                        self._holder())
        remove_stale_temps(self.dir)
        write_atomic(self.info, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                            "argv": sys.argv}))
        self._identity = (path_identity(self.dir), path_identity(self.dir / ".lock"))
        return self

    def verify(self) -> None:
        """Raise RunDirError unless the directory is still the one this lock was taken on, and the lock file in
        it still ours: a directory deleted, moved or replaced mid-run holds someone else's rows, or none."""
        now = (path_identity(self.dir), path_identity(self.dir / ".lock"))
        if now != self._identity or not self._lock.is_locked:
            i = 0 if now[0] != self._identity[0] else 1  # the directory, else the lock file in it
            what = ("directory", "lock file")[i]
            raise RunDirError(
                f"{self.dir} was deleted, moved or replaced while this run was writing it ({what} "
                f"{_fmt_identity(self._identity[i])} at the start, {_fmt_identity(now[i])} now): the rows there are "
                "not all this run's. Nothing was counted and no results were written; rerun into a directory no "
                "other process touches.")

    def _holder(self) -> str:
        try:
            h = json.loads(self.info.read_text())
            return f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"
        except (OSError, ValueError):
            return "holder unknown"

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        same = path_identity(self.dir) == self._identity[0]
        if same:
            self.info.unlink(missing_ok=True)
        self._lock.release()
        if same and self._created and set(os.listdir(self.dir)) <= {".lock"}:
            # a start that wrote nothing leaves no directory behind
            (self.dir / ".lock").unlink(missing_ok=True)
            for d in reversed(self._created):
                try:
                    d.rmdir()  # only while empty: anything written stays
                except OSError:
                    break

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def path_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _fmt_identity(ident: tuple[int, int] | None) -> str:
    return "gone" if ident is None else f"device {ident[0]}, inode {ident[1]}"


def move_aside(run_dir: Path, names: Iterable[str] | None = None) -> Path | None:
    """``--overwrite``: the previous run's files (``names``; default every file but the lock and earlier
    ``replaced-*`` folders) go to ``RUN/replaced-TIMESTAMP/``; nothing finished is ever deleted (delete that
    folder yourself once you are sure)."""
    present = [p for p in run_dir.iterdir() if p.name not in (".lock", ".lock.json")
               and not p.name.startswith("replaced-") and (names is None or p.name in set(names))]
    if not present:
        return None
    dest = run_dir / f"replaced-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S.%f')}"
    dest.mkdir()
    for p in present:
        os.replace(p, dest / p.name)
    log.warning("--overwrite: the previous run's files (%s) were moved to %s", ", ".join(p.name for p in present),
                dest)
    return dest


# ----------------------------------------------------------------------------------------------- run.json
def check_run_meta(run_dir: Path, config_hash: str, hashed: dict) -> bool:
    """Raise ResumeMismatchError naming every changed setting if ``run_dir`` holds another run; True if it
    holds this one, False if it holds none yet."""
    meta = run_dir / "run.json"
    if not meta.exists():
        return False
    try:
        prev = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise RunDirError(f"{meta} is unreadable ({e}); move it away to resume from samples.jsonl alone (rows "
                          "made with other settings are still refused, by their own hash)") from e
    if prev.get("config_hash") != config_hash:
        raise ResumeMismatchError(
            f"{run_dir} holds a run made with other settings: {describe_changes(prev.get('hashed', {}), hashed)} "
            f"(settings hash {prev.get('config_hash')} there, {config_hash} now). Use a new --output, or "
            "--overwrite to start over (the old run's files are moved aside, not deleted).")
    return True


def write_run_meta(run_dir: Path, config_hash: str, hashed: dict, config: dict) -> None:
    write_atomic(run_dir / "run.json", json.dumps({"config_hash": config_hash, "hashed": hashed, "config": config},
                                                  indent=2, default=str))


# ------------------------------------------------------------------------------------------- samples.jsonl
class SampleLog:
    """Append-only JSONL keyed by ``id@position``; reopening it skips what is already there.

    Reading never deletes a finished row: a line that does not parse (garbage, a blank line, a cut UTF-8
    character, a record without ``key``) is skipped and reported by line number, and only an unterminated
    final line, what a kill mid-write leaves, is cut off. With several ranks each appends to its own shard
    (``samples.rankN.jsonl``) and every rank reads all shards, so a resumed run knows what is done whatever
    the number of ranks before; ``merge`` folds the shards into one ``samples.jsonl``."""

    def __init__(self, out_dir: str | Path, shard: str | None = None, read_only: bool = False):
        """``read_only``: never repair a file (a report may read a run that another process is writing)."""
        self.dir = Path(out_dir)
        self.path = self.dir / ("samples.jsonl" if shard is None else f"samples.{shard}.jsonl")
        self.records: dict[str, dict] = {}
        self.origin: dict[str, tuple[Path, int]] = {}  # the file and line each record was read from
        self.bad_lines: dict[Path, list[tuple[int, bytes]]] = {}
        self.duplicates = 0
        for f in self._files():
            self._load(f, own=(f == self.path and not read_only))
        self._fh = None
        self._dir_id = path_identity(self.dir)

    def _files(self) -> list[Path]:
        return [f for f in [self.dir / "samples.jsonl", *sorted(self.dir.glob("samples.rank*.jsonl"))] if f.exists()]

    def _load(self, path: Path, own: bool) -> None:
        data = path.read_bytes()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends in a newline; else an unterminated last line
        bad = []
        for lineno, raw in enumerate(lines, 1):
            rec = _parse(raw)
            if rec is None:
                bad.append((lineno, raw))
                continue
            self._add(rec, path, lineno)
        rec = _parse(tail) if tail else None
        if rec is not None:  # complete JSON, only its newline was lost: keep it
            self._add(rec, path, len(lines) + 1)
        if tail and own and rec is not None:  # repair our own file: restore the newline ...
            with open(path, "ab") as fh:
                fh.write(b"\n")
        elif tail and own:  # ... or drop the line a kill cut short
            log.warning("%s: its last line (line %d) was cut short by an interrupted write; it is dropped and that "
                        "instance redone", path, len(lines) + 1)
            with open(path, "r+b") as fh:
                fh.truncate(len(data) - len(tail))
        if bad:
            self.bad_lines[path] = bad
            nums = ", ".join(str(n) for n, _ in bad[:10]) + (", ..." if len(bad) > 10 else "")
            log.warning("%s: %d unreadable line(s) skipped (line %s); every other row is kept", path, len(bad), nums)

    def _add(self, rec: dict, path: Path, lineno: int) -> None:
        """A later row of a key replaces the earlier one (a stale row regenerated: another prompt or gold). The
        same prompt and gold with another outcome is no regeneration: the row is named in a warning."""
        old = self.records.get(rec["key"])
        if old is not None:
            self.duplicates += 1
            same_input = all(old.get(k) == rec.get(k) for k in ("prompt_sha256", "gold", "config_hash"))
            if same_input and old != rec:
                log.warning("%s: row %r appears again at line %d with the same prompt and settings but another "
                            "outcome (generation or scores); the later line is used. Remove the line that should "
                            "not count, or rerun with --overwrite", path, rec["key"], lineno)
        self.records[rec["key"]] = rec
        self.origin[rec["key"]] = (path, lineno)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def write(self, records: Iterable[dict]) -> None:
        """Append and fsync; refuse (RunDirError) once the directory or the file is not the one this log opened:
        rows written after another process replaced it would land where nobody counts them, or in its run."""
        if self._fh is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._dir_id = self._dir_id or path_identity(self.dir)
            self._fh = open(self.path, "a", encoding="utf-8")
        self._check_still_ours()
        for rec in records:
            self.records[rec["key"]] = rec
            self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def _check_still_ours(self) -> None:
        try:
            same_file = os.stat(self.path).st_ino == os.fstat(self._fh.fileno()).st_ino
        except OSError:
            same_file = False
        if path_identity(self.dir) != self._dir_id or not same_file:
            raise RunDirError(f"{self.path} is no longer the file this run opened: its directory or the file was "
                              "deleted, moved or replaced by another process mid-run. Nothing more is written; "
                              "rerun into a directory no other process touches.")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def merge(self, order: list[str], config_hash: str) -> None:
        """Re-read every shard, write one samples.jsonl of this run's rows (``order`` first, then any other keys),
        drop the shards. Unreadable lines and rows of other settings (another hash, or none) are moved to
        ``samples.rejected.txt`` with their file and line number, never dropped, and never counted."""
        self.records, self.bad_lines, self.duplicates = {}, {}, 0
        files = self._files()
        for f in files:
            self._load(f, own=False)
        foreign = {k: r for k, r in self.records.items() if r.get("config_hash") != config_hash}
        if self.bad_lines or foreign:
            rejected = self.dir / "samples.rejected.txt"
            lines = [f"{f.name}:{n}: ".encode() + raw for f, bad in self.bad_lines.items() for n, raw in bad]
            lines += [f"settings hash {r.get('config_hash')}, not this run's {config_hash}: ".encode()
                      + json.dumps(r, ensure_ascii=False).encode() for r in foreign.values()]
            have = set(rejected.read_bytes().split(b"\n")) if rejected.exists() else set()
            with open(rejected, "ab") as fh:  # once each, however many merges failed before this one
                fh.writelines(line + b"\n" for line in dict.fromkeys(lines) if line not in have)
            for k in foreign:
                del self.records[k]
            log.warning("%s: %d unreadable line(s) and %d row(s) of other settings moved to samples.rejected.txt",
                        self.dir, sum(map(len, self.bad_lines.values())), len(foreign))
        ordered = set(order)
        keys = [k for k in order if k in self.records] + [k for k in self.records if k not in ordered]
        write_atomic(self.dir / "samples.jsonl",
                     "".join(json.dumps(self.records[k], ensure_ascii=False) + "\n" for k in keys))
        for f in files:
            if f.name != "samples.jsonl":
                f.unlink()


def _parse(raw: bytes) -> dict | None:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("key"), str) else None


# What a changed key of the resolved settings is called in an error line.
LABELS = {"model_weights": "model weights", "model_config": "model config (config.json)",
          "tokenizer_files": "tokenizer files", "software": "package versions", "data_sha256": "data file",
          "template_sha256": "template", "dtype": "dtype", "device_type": "device type", "model": "model",
          "scan": "Phi-Mamba scan path", "vllm_engine": "vLLM (version and engine settings)",
          "linear": "CPU linear kernel (ICR_CPU_LINEAR)", "attention": "CPU attention kernel (ICR_CPU_FLASH)",
          "kept_positions": "a prefill's last layer for its kept positions only (ICR_KEPT_POSITIONS)"}


def describe_changes(old: dict, new: dict) -> str:
    """``model weights changed since this run started: 1a2b… → 3c4d…; ...`` for every key that differs."""
    parts = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            sub = [f"{s} {a.get(s)} → {b.get(s)}" for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
            parts.append(f"{LABELS.get(k, k)} changed since this run started: {', '.join(sub)}")
        else:
            parts.append(f"{LABELS.get(k, k)} changed since this run started: {_short(a)} → {_short(b)}")
    return "; ".join(parts) or "unknown (run.json predates hashing)"


def _short(v) -> str:
    return "none" if v is None else repr(v) if not isinstance(v, str) else v
