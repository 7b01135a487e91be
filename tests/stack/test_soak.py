"""The 2-minute soak (scripts/soak.py --minutes 2): the Azure conversation trace, time-scaled to
this machine, through the SDK against a whole stack. Zero requests lost, no service dies, Redis
is back to its starting key count, and no service's memory keeps growing after the warm-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nightjar import paths

TRACE = paths.TRACES_DIR / "AzureLLMInferenceTrace_conv.csv"


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.is_file(), reason=f"the Azure trace is not at {TRACE}")
def test_two_minute_soak(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(paths.ROOT / "scripts" / "soak.py"), "--minutes", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=str(paths.ROOT))
    print(proc.stdout[-4000:])
    assert out.is_file(), proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["requests"] >= 20, rep  # the trace really ran
    assert rep["lost"] == 0, rep["errors"]
    assert rep["ok"] + rep["refused"] == rep["requests"]
    assert rep["ok"] >= 0.9 * rep["requests"], "at 0.7 x capacity almost nothing should be shed"
    assert not rep["services_died"]
    before, after = rep["redis_keys"]
    assert after <= before + 2, f"Redis keys {before} -> {after}: per-request keys left behind"
    # Two minutes is short for a leak to show: a bound loose enough for the noise of a shared
    # 2-core box, tight enough to catch per-request growth (the 30-minute run holds < 5%).
    for name, v in rep["rss_mb"].items():
        assert v["growth_pct"] < 10.0, f"{name}: RSS {v['warm']} -> {v['end']} MB after the warm-up"
    assert proc.returncode == 0, proc.stderr[-2000:]
