"""Process lifetimes: a child process never outlives the process that started it, and a scheduler's SIGTERM
ends a run as Ctrl-C does (``finally`` blocks run: children are stopped, locks released, what finished kept).
And a child Python that reports one JSON result (work that must not share this process: Triton's interpreter,
a search that may leave the GPU unusable)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a child: the kernel sends it SIGKILL when its parent dies, however the parent dies
    (Linux ``PR_SET_PDEATHSIG``; a thread watching the parent's pid elsewhere). The signal follows the *thread*
    that started the child, so start children from one long-lived thread."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    else:  # best effort where the kernel offers no parent-death signal
        def watch():
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)


@contextlib.contextmanager
def stop_on_sigterm():
    """Inside: SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def python_result(code: str, *, timeout: float, stdin: str | None = None, env: dict | None = None,
                  cwd=None) -> tuple[dict | None, subprocess.CompletedProcess]:
    """Run ``code`` in a child Python; the JSON it printed on a line starting ``RESULT `` (None if it printed
    none), and the finished process for its exit status and output."""
    res = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=cwd)
    line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    return (json.loads(line[len("RESULT "):]) if line else None), res


def exit_description(code: int | None) -> str:
    """How a cell's process ended, in words: a signal named (SIGKILL is most often the out-of-memory killer), or
    its exit code."""
    if code is None:
        return "still running"
    signum = -code if code < 0 else code - 128 if code > 128 else None
    if signum:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        why = {"SIGKILL": " (out of memory, most often: the kernel's OOM killer; or killed by hand)",
               "SIGTERM": " (stopped: a scheduler, a shutdown, or by hand)",
               "SIGSEGV": " (a crash in native code)"}.get(name, "")
        return f"killed by {name}{why}"
    return f"exit code {code}"


def project_env(**extra: str) -> dict:
    """The environment for a child Python that must import this checkout, whatever (if anything) pip installed,
    plus ``extra``."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])), **extra}


def process_started() -> float:
    """When this process started, on ``time.perf_counter()``'s clock: a budget "from the start" counts the
    interpreter's start and every import (Linux: /proc/self/stat's start time; elsewhere, this module's import)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= age < 86400:
            return time.perf_counter() - age
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORTED


_IMPORTED = time.perf_counter()
