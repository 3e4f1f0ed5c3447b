"""Process lifetimes: a child process never outlives the process that started it, and a scheduler's SIGTERM
ends a run as Ctrl-C does (``finally`` blocks run: children are stopped, locks released, what finished kept).
And a child Python that reports one JSON result (work that must not share this process: Triton's interpreter,
a search that may leave the GPU unusable)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a child: it dies (SIGKILL) when ``parent_pid``, the process that asked for it, dies,
    however that process dies. A direct child: Linux's ``PR_SET_PDEATHSIG`` (the signal follows the *thread* that
    started the child, so start children from one long-lived thread). A fork server's child, or where the kernel
    offers no such signal: a thread here waits on ``parent_pid`` (the server outlives that process while its
    children hold it open, so its own death would not come)."""
    direct = os.getppid() == parent_pid and sys.platform.startswith("linux")
    if direct:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            direct = False
    if not direct:
        threading.Thread(target=_die_after, args=(parent_pid,), daemon=True).start()
    if os.getppid() != parent_pid and not pid_alive(parent_pid):  # it died before the signal was armed
        os._exit(0)


def _die_after(pid: int) -> None:
    """Wait for ``pid`` to end (a pidfd where the kernel has them: woken at its death; else polled), then die as
    ``PR_SET_PDEATHSIG`` would kill this process."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        while pid_alive(pid):
            time.sleep(0.5)
    else:
        select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def forks(*, cuda: bool) -> bool:
    """Whether ``child_context(cuda=cuda)`` forks children from a server (else: a fresh interpreter each)."""
    return not cuda and "forkserver" in multiprocessing.get_all_start_methods()


def child_context(*, cuda: bool, preload: tuple[str, ...] = ()):
    """How this project starts Python children (grid cells, cells side by side, data workers); ``cuda``: whether
    the children use CUDA. Without it: a fork server that imported ``preload`` once forks each child, which starts
    in a fraction of a second instead of a fresh interpreter's 6-7 CPU-seconds of torch and transformers imports
    (most of a tiny CPU cell's life; a demo trains nine). With it: a fresh interpreter each (spawn): a child forked
    after CUDA was touched cannot use it, and each GPU cell chooses the device it sees in the environment it starts
    with; an hours-long GPU cell does not notice its start-up. A fork server's children inherit its environment as
    it was when its first child started (``multiprocessing``'s rule)."""
    if not forks(cuda=cuda):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


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
