"""Python ``re`` search with a hard time limit.

``re`` cannot be interrupted from inside the process (a catastrophic backtrack holds the interpreter in C
code), so matches run in worker processes that are killed and replaced when a search overruns. Workers are
reused across calls (the usual cost is a pipe round trip), one per concurrent search, so the searches of one
decoding step run side by side and a batch of timeouts costs one timeout of wall time.

A worker never outlives the evaluation: it asks the kernel for SIGKILL when its parent dies (Linux
``PR_SET_PDEATHSIG``; a thread watching the parent pid elsewhere), whatever killed the parent. That signal
follows the *thread* that forked the worker, so every worker is forked by one long-lived thread."""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from harness.procs import die_with_parent

MAX_PATTERN_CHARS = 512
CAPTURE = -1  # ``max_matches`` value asking for the first match's captured group instead of whole units


@dataclass
class SearchOutcome:
    status: str  # "ok" | "no_match" | "error" | "timeout"
    matches: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


@functools.lru_cache(maxsize=8192)
def _compiled(pattern: str) -> re.Pattern:
    """``re``'s own cache holds 512 patterns; one IsTree evaluation at n = 64 asks for ~4,300 distinct ones."""
    return re.compile(pattern)


def _matches(pattern: str, units: list[str], max_matches: int) -> list[str]:
    """What a search returns: the matching units in order (at most ``max_matches``; 0 = all), or with
    ``CAPTURE`` the first match's first participating group (else the whole match) in ``units[0]``."""
    rx = _compiled(pattern)
    found = []
    if max_matches == CAPTURE:
        m = rx.search(units[0]) if units else None
        if m:
            found.append(next((g for g in m.groups() if g is not None), m.group(0)))
    else:
        for u in units:
            if rx.search(u):
                found.append(u)
                if max_matches and len(found) >= max_matches:
                    break
    return found


def _refused(pattern: str) -> str | None:
    """Why a pattern is not searched at all (empty, too long, not a regex), else None."""
    if not pattern:
        return "empty pattern"
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"pattern longer than {MAX_PATTERN_CHARS} characters"
    try:
        _compiled(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return f"invalid pattern: {e}"
    return None


def _worker(conn, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    units: list[str] = []
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        new_units, pattern, max_matches = msg
        if new_units is not None:
            units = new_units
        conn.send(_matches(pattern, units, max_matches))


class _Worker:
    def __init__(self):
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.units_key = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=1)
        self.conn.close()


_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="icr-regex-spawn")


class _Searcher:
    """What every searcher answers the same way: the refusals, the outcome's status, its seconds."""

    def capture(self, pattern: str, text: str) -> SearchOutcome:
        """``re.search(pattern, text)``; ``matches`` holds its first participating group (or the whole match)."""
        return self.search(pattern, [text], CAPTURE)

    def search(self, pattern: str, units: list[str], max_matches: int = 0) -> SearchOutcome:
        """The units matching ``pattern`` (at most ``max_matches``; 0 = all), in order."""
        t0 = time.perf_counter()
        refused = _refused(pattern)
        found = SearchOutcome("error", error=refused) if refused else self._found(pattern, units, max_matches)
        out = found if isinstance(found, SearchOutcome) else SearchOutcome("ok" if found else "no_match", found)
        out.seconds = time.perf_counter() - t0
        return out

    def _found(self, pattern: str, units: list[str], max_matches: int) -> list[str] | SearchOutcome:
        """The matches, or the outcome of a search that gave none (a timeout, a worker that died)."""
        raise NotImplementedError


class RegexSearcher(_Searcher):
    """Search a list of text units for a pattern; return the units that match, in order. Thread-safe:
    concurrent calls each take an idle worker (or a new one)."""

    def __init__(self, timeout: float = 1.0):
        if not (timeout > 0 and timeout != float("inf")):
            raise ValueError(f"the search timeout must be a positive finite number of seconds, got {timeout!r}")
        self.timeout = timeout
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()

    def __reduce__(self):
        """Pickled as its setting: in another process (an audit's reference run) it is that process's own pool."""
        return shared_searcher, (self.timeout,)

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.is_alive():
                    self._busy.add(w)
                    return w
                w.kill()
        w = _SPAWNER.submit(_Worker).result()
        with self._lock:
            self._busy.add(w)
        return w

    def _release(self, w: _Worker, ok: bool) -> None:
        with self._lock:
            self._busy.discard(w)
            if ok:
                self._idle.append(w)
        if not ok:
            w.kill()

    def worker_pids(self) -> list[int]:
        """Pids of the live workers (idle and busy), for tests and diagnostics."""
        with self._lock:
            return [w.pid for w in [*self._idle, *self._busy] if w.proc.is_alive()]

    def close(self) -> None:
        with self._lock:
            workers, self._idle, self._busy = [*self._idle, *self._busy], [], set()
        for w in workers:
            w.kill()

    def _found(self, pattern: str, units: list[str], max_matches: int) -> list[str] | SearchOutcome:
        key = hash(tuple(units))  # content, not identity: a freed list's id can be reused
        w = self._take()
        try:
            try:
                w.conn.send((None if key == w.units_key else units, pattern, max_matches))
            except (BrokenPipeError, OSError):  # died while idle: nothing was lost, use a fresh one
                self._release(w, ok=False)
                w = self._take()
                w.conn.send((units, pattern, max_matches))
            w.units_key = key
            if not w.conn.poll(self.timeout):
                self._release(w, ok=False)
                return SearchOutcome("timeout", error=f"search stopped after {self.timeout:g}s")
            matches = w.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
            self._release(w, ok=False)
            return SearchOutcome("error", error=f"the regex worker died mid-search ({type(e).__name__}); "
                                 "a fresh worker takes the next search")
        self._release(w, ok=True)
        return matches

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class InProcessSearcher(_Searcher):
    """The same searches in this process, with no time limit: only for patterns a tool builds itself from a closed
    grammar (IsTree's three queries), which cannot backtrack catastrophically. A model-written pattern always goes
    to ``RegexSearcher``'s killable workers. A worker's round trip (a pipe, two process wake-ups) costs ~35x such a
    search (~180 us against ~5 us on a 2-core machine); a tool-heavy evaluation makes one a row every few tokens."""

    def _found(self, pattern: str, units: list[str], max_matches: int) -> list[str]:
        return _matches(pattern, units, max_matches)


_shared: dict[float, RegexSearcher] = {}
_shared_lock = threading.Lock()


def shared_searcher(timeout: float = 1.0) -> RegexSearcher:
    """One worker pool per timeout setting per process, so many tools do not fork many workers."""
    with _shared_lock:
        if timeout not in _shared:
            _shared[timeout] = RegexSearcher(timeout)
        return _shared[timeout]
