"""A CPU run keeps the memory its tensors free (``harness/backends/cpu_heap.py``), measured in real processes by
the page faults of a tensor freed and taken again, and a bad ``ICR_CPU_HEAP`` is named. (The 24 HotpotQA
prompts' prefill, ``benchmarks/throughput.py``'s, went from ~220k faults a run to a few hundred, at the same
peak memory.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.backends import cpu_heap

REPO = Path(__file__).resolve().parents[1]
CODE = """
import json, resource, torch
from harness.backends import cpu_heap
kept = cpu_heap.keep_freed_memory(torch.device("cpu"))
faults = []
for _ in range(24):  # 200 MB taken, written and freed, 24 times; the page faults of each round
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(50 * 2 ** 20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([kept, faults]))
"""


def _run(setting: str):
    env = {**os.environ, "ICR_CPU_HEAP": setting}
    return json.loads(subprocess.run([sys.executable, "-c", CODE], env=env, cwd=REPO, capture_output=True,
                                     text=True, check=True).stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_taken_again_without_page_faults_unless_released():
    kept, faults = _run("keep")
    if kept is None:
        pytest.skip("not glibc: malloc left as it is")
    released, faults_released = _run("release")
    assert released is None and "mmap threshold" in kept
    pages = 200 * 2 ** 20 // 4096
    assert min(faults_released) > pages // 2  # released: every round faults its pages in again ...
    # ... kept: the first rounds do (glibc's heap grows for some rounds of one aligned size: 5 to 9 seen), then none
    assert faults[0] > pages // 2 and max(faults[-6:]) < pages // 20


def test_a_bad_setting_is_named_and_other_devices_are_left_alone(monkeypatch):
    monkeypatch.setenv("ICR_CPU_HEAP", "forever")
    with pytest.raises(ValueError, match="ICR_CPU_HEAP='forever': use keep or release"):
        cpu_heap.keep_freed_memory(torch.device("cpu"))
    monkeypatch.setenv("ICR_CPU_HEAP", "keep")
    assert cpu_heap.keep_freed_memory(torch.device("meta")) is None
