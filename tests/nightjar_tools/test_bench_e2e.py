"""``nightjar bench`` end to end: a real stack (embedded Redis, gateway, scheduler, planner,
worker with the shipped models), one policy, a short steady load, and every artefact written."""

from __future__ import annotations

import json

import pytest

from nightjar_tools.bench.cli import main

pytestmark = pytest.mark.slow


def test_bench_runs_against_a_real_stack(tmp_path):
    out, plots_dir = tmp_path / "out", tmp_path / "plots"
    # Capacity and γ given, so no calibration stack: one stack start, ~14 s of load; then the
    # hindsight oracle's stack, which can only pick the γ = 2 that fixed:2 measured, and whose
    # table the bench keeps in force past the workers' 10 s policy TTL.
    rc = main(["--policies", "fixed:G", "--workloads", "poisson:0.5@14", "--capacity-rps", "1.2", "--fixed-gamma", "2",
               "--drain-timeout-s", "40", "--output-scale", "0.3", "--max-output", "24", "--oracle",
               "--out", str(out), "--plots-dir", str(plots_dir), "--no-progress"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    run, oracle = data["runs"]
    assert oracle["policy"] == "oracle" and set(oracle["oracle_table"].values()) == {2}
    assert oracle["ok"] == oracle["sent"] >= 1 and oracle["engine"]["spec_step_share"] >= 0.9  # the published table ran
    assert run["policy"] == "fixed:2" and run["sent"] >= 1
    assert data["config"]["draft_model"].endswith("tiny-draft") and data["config"]["draft_weight_bytes"] > 0
    assert run["ok"] == run["sent"], run["errors"]
    assert run["output_tokens"] > 0 and run["ttft_s"]["mean"] > 0 and run["speed_probe_ms"] > 0
    engine = run["engine"]
    assert engine["steps"] > 0 and engine["emitted_tokens"] >= run["output_tokens"]
    assert engine["spec_step_share"] > 0  # the planner's fixed γ = 2 reached the worker
    samples = data["samples"]["fixed:2|poisson:0.5"]
    assert samples and any(s.get("kv_blocks_total") for s in samples)
    assert "| poisson:0.5 | fixed:2 |" in (out / "report.md").read_text()
    assert (plots_dir / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert (plots_dir / "timeline_fixed_2_poisson_0.5.png").is_file()
