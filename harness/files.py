"""Files written whole or not at all: a kill, a full disk or a power loss leaves the old file or the new one,
never half of one, and JSON that every reader parses. A leaf: the engine, the trainer and the reports use it."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from harness.procs import pid_alive


def write_atomic(path: str | Path, text: str) -> Path:
    """Write to a temporary file beside ``path``, fsync, then rename over it: a kill leaves old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a kill signal turned exception: no temp file is left behind
        tmp.unlink(missing_ok=True)
        raise
    return path


def strict_json(obj, **kw) -> str:
    """JSON every reader accepts: a NaN or infinite float (a standard error of one row, a diverged loss) is
    written as null, never as the bare ``NaN`` that JavaScript, Go and jq refuse."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), allow_nan=False, **kw)


def write_json(path: str | Path, obj, **kw) -> Path:
    """``obj`` as strict JSON (``strict_json``), written atomically."""
    return write_atomic(path, strict_json(obj, **kw))


def remove_stale_temps(directory: Path) -> list[Path]:
    """Temp files ``write_atomic`` left in ``directory`` when its process died before it could clean up (SIGKILL,
    power loss): those of processes no longer alive are removed."""
    gone = []
    for tmp in directory.glob(".*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            gone.append(tmp)
    return gone


def printable(text: str) -> str:
    """``text`` as UTF-8 can hold it: a lone surrogate (valid in JSON, from a generation or a file name that is
    not UTF-8) is written as its escape (``\\ud800``), never a crash of the writer."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class StagedFiles:
    """A set of files that replaces the set a folder held before all at once: each file is written into a hidden
    staging folder inside ``dest``, and only ``commit`` moves them into place (renames, which a full disk cannot
    fail), writes the list of what it holds (``manifest``) and removes the old set's files the new one lacks. A
    failure, a full disk or an interrupt before ``commit`` leaves the old set whole; an interrupt during it is held
    until the moves are done. Nothing in ``dest`` that the old manifest does not list is touched."""

    def __init__(self, dest: Path, manifest: str):
        self.dest, self.manifest = Path(dest), manifest
        self.created = not self.dest.exists()
        self.dest.mkdir(parents=True, exist_ok=True)
        for stale in self.dest.glob(".staging-*"):  # left by a process killed before it could clean up
            pid = stale.name.split("-")[1]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f".staging-{os.getpid()}-", dir=self.dest))
        self.names: list[str] = []

    def path(self, name: str) -> Path:
        """Where a file named ``name`` is staged (for writers that take a path, as matplotlib does); ``add`` it."""
        return self.dir / name

    def add(self, name: str) -> Path:
        if name not in self.names:
            self.names.append(name)
        return self.dest / name

    def write_text(self, name: str, text: str) -> Path:
        with open(self.path(name), "w", encoding="utf-8") as fh:
            fh.write(printable(text))
            fh.flush()
            os.fsync(fh.fileno())
        return self.add(name)

    def commit(self) -> list[Path]:
        listed = self.dest / self.manifest
        old = listed.read_text().split() if listed.exists() else []
        held = []
        main = threading.current_thread() is threading.main_thread()  # only there can a signal handler be set
        previous = signal.signal(signal.SIGINT, lambda *_: held.append(1)) if main else None
        try:
            for name in self.names:
                os.replace(self.dir / name, self.dest / name)
            write_atomic(listed, "".join(f"{n}\n" for n in self.names))
            for name in old:
                if "/" not in name and name not in self.names:
                    (self.dest / name).unlink(missing_ok=True)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            self.discard()
        if held:
            raise KeyboardInterrupt
        return [self.dest / n for n in self.names]

    def discard(self) -> None:
        """Drop what was staged (the old set stays); a destination this object created and left empty goes too."""
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.created and self.dest.is_dir() and not any(self.dest.iterdir()):
            self.dest.rmdir()
