"""deploy/grafana/nightjar.json queries only metric names the services export, and covers what
an operator of adaptive speculation looks at."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import ProcessCollector

from nightjar import metrics as m

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "nightjar.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    names = set()
    for collectors in m.ROLES.values():
        for c in collectors:
            for fam in c.describe():
                names.update(fam.name + s for s in _SUFFIXES[fam.type])
    for fam in ProcessCollector(registry=None).collect():
        names.update(s.name for s in fam.samples)
    return names


def test_dashboard_uses_only_exported_names():
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\b((?:nightjar|process)_[a-z0-9_]+)", e)}
    exported = exported_names()
    assert used and not used - exported, sorted(used - exported)
    assert "process_resident_memory_bytes" in exported  # the check would pass vacuously otherwise
    for required in ("nightjar_gamma", "nightjar_draft_residency", "nightjar_kv_cache_usage_perc",
                     "nightjar_time_to_first_token_seconds_bucket", "nightjar_inter_token_latency_seconds_bucket",
                     "nightjar_e2e_request_latency_seconds_bucket",
                     "nightjar_spec_decode_num_accepted_tokens_per_pos_total", "nightjar_gateway_requests_queued",
                     "nightjar_num_requests_waiting"):
        assert required in used, required
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_docs_metrics_names_exist():
    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    named = set(re.findall(r"`((?:nightjar|process)_[a-z0-9_]+)`", text))
    families = {fam.name for cs in m.ROLES.values() for c in cs for fam in c.describe()}
    unknown = named - exported_names() - families
    assert named and not unknown, sorted(unknown)
    documented = {n.removesuffix("_total") for n in named}
    assert families <= documented, sorted(families - documented)  # every family is listed
