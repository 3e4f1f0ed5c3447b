"""``--audit N``: a run regenerates N of its rows the simplest way (alone, unpadded, no prefix reuse, float32)
and records how many agree; a row that does not match what the model writes is found (issue 21)."""
import json

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
    assert audit["reference"] == {"batch": 1, "prefix_reuse": "none", "cuda_graphs": False, "dtype": "float32"}
