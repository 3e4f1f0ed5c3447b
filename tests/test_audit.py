"""``--audit N``: a run regenerates N of its rows the simplest way (alone, unpadded, no prefix reuse, float32)
and records how many agree; a row that does not match what the model writes is found (issue 21)."""
import json

import pytest

from harness.engine import run_eval
from tests.helpers import assert_varied, run_config


def test_an_audit_of_a_cpu_run_agrees_and_a_tampered_row_is_found(tiny_phi_dir, phi_backend, tmp_path):
    out = tmp_path / "run"
    cfg = run_config(tiny_phi_dir, out, limit=4, max_new_tokens=16, batch_size="4", audit=5)
    res = run_eval(cfg, backend=phi_backend, progress=False)
    rows = [json.loads(l) for l in (out / "samples.jsonl").read_text().splitlines()]
    assert_varied([r["generation"] for r in rows])  # batched with a shared prefix: the audit compares real work
    assert res["audit"]["rows"] == 5 and res["audit"]["agree"] == 5 and res["audit"]["differ"] == []
    assert "audit: 5 of 5 rows" in res["table"]
    # a row the model would not write (what a wrong kernel or padding bug leaves) is found by an audit of all rows
    rows[2]["generation"] = rows[2]["generation"][:5] + "#" + rows[2]["generation"][6:]
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_eval(run_config(tiny_phi_dir, out, limit=4, max_new_tokens=16, batch_size="4", audit=100),
                   backend=phi_backend, progress=False)
    assert res["counts"]["resumed"] == len(rows)
    audit = res["audit"]
    assert audit["rows"] == len(rows) and audit["agree"] == len(rows) - 1
    (bad,) = audit["differ"]
    assert bad["key"] == rows[2]["key"] and bad["char"] == 5 and bad["run"].startswith(rows[2]["generation"][:6])
    assert audit["reference"] == {"backend": "transformers", "process": "same", "batch": 1, "prefix_reuse": "none",
                                  "cuda_graphs": False, "dtype": "float32"}


@pytest.mark.slow
def test_the_reference_of_an_engine_runs_in_a_child_and_generates_what_the_backend_generates(tiny_phi_dir,
                                                                                              phi_backend, tmp_path):
    """vLLM's audit regenerates its rows with the transformers backend in a child process (its own cache and
    scheduler would audit themselves): the requests, each with its own retrieval tool, travel to the child and
    come back as the same generations the backend makes here, alone."""
    from harness.engine.audit import generate_in_child
    from harness.engine.run import EvalRun

    cfg = run_config(tiny_phi_dir, tmp_path / "run", limit=3, max_new_tokens=24, retrieval=True)
    run = EvalRun(cfg, backend=phi_backend, progress=False)
    requests = [run.request(ins) for ins in run.instances[:4]]
    assert all(r.tool is not None for r in requests)
    here = [(o.text, o.finish_reason) for r in requests for o in phi_backend.generate([r])]
    assert_varied([t for t, _ in here])
    fresh = [run.request(ins) for ins in run.instances[:4]]  # fresh tools, as the audit builds them
    assert generate_in_child(run.prepared.model.reference("transformers"), fresh) == here
