"""Python ``re`` search with a hard time limit.

``re`` cannot be interrupted from inside the process (a catastrophic backtrack holds the interpreter in C
code), so the match runs in a persistent worker process that is killed and replaced when a search overruns.
A worker is reused across calls, so the usual cost is a pipe round trip, not a process start."""
from __future__ import annotations

import multiprocessing as mp
import re
import threading
import time
from dataclasses import dataclass, field

MAX_PATTERN_CHARS = 512
CAPTURE = -1  # ``max_matches`` value asking for the first match's captured group instead of whole units


@dataclass
class SearchOutcome:
    status: str  # "ok" | "no_match" | "error" | "timeout"
    matches: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def _worker(conn) -> None:
    units: list[str] = []
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        new_units, pattern, max_matches = msg
        if new_units is not None:
            units = new_units
        rx = re.compile(pattern)
        found = []
        if max_matches == CAPTURE:  # first match over the joined text: its first group that matched
            m = rx.search(units[0]) if units else None
            if m:
                found.append(next((g for g in m.groups() if g is not None), m.group(0)))
        else:
            for u in units:
                if rx.search(u):
                    found.append(u)
                    if max_matches and len(found) >= max_matches:
                        break
        conn.send(found)


class RegexSearcher:
    """Search a list of text units for a pattern; return the units that match, in order."""

    def __init__(self, timeout: float = 1.0):
        self.timeout = timeout
        self._proc = None
        self._conn = None
        self._units_key = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._units_key = None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=1)
        self._proc = self._conn = None
        self._units_key = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def capture(self, pattern: str, text: str) -> SearchOutcome:
        """``re.search(pattern, text)``; ``matches`` holds its first participating group (or the whole match)."""
        return self.search(pattern, [text], CAPTURE)

    def search(self, pattern: str, units: list[str], max_matches: int = 0) -> SearchOutcome:
        """The units matching ``pattern`` (at most ``max_matches``; 0 = all), in order."""
        t0 = time.perf_counter()
        if not pattern:
            return SearchOutcome("error", error="empty pattern", seconds=time.perf_counter() - t0)
        if len(pattern) > MAX_PATTERN_CHARS:
            return SearchOutcome("error", error=f"pattern longer than {MAX_PATTERN_CHARS} characters",
                                 seconds=time.perf_counter() - t0)
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:
            return SearchOutcome("error", error=f"invalid pattern: {e}", seconds=time.perf_counter() - t0)
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            key = hash(tuple(units))  # content, not identity: a freed list's id can be reused
            self._conn.send((None if key == self._units_key else units, pattern, max_matches))
            self._units_key = key
            if not self._conn.poll(self.timeout):
                self._kill()
                return SearchOutcome("timeout", error=f"search stopped after {self.timeout:g}s",
                                     seconds=time.perf_counter() - t0)
            matches = self._conn.recv()
        return SearchOutcome("ok" if matches else "no_match", matches, seconds=time.perf_counter() - t0)

    def __del__(self):
        try:
            self._kill()
        except Exception:
            pass


_shared: dict[float, RegexSearcher] = {}


def shared_searcher(timeout: float = 1.0) -> RegexSearcher:
    """One worker per timeout setting per process, so many tools do not fork many workers."""
    if timeout not in _shared:
        _shared[timeout] = RegexSearcher(timeout)
    return _shared[timeout]
