"""Rich tables for the dicts that ``reader.QueueReader`` returns (the JSON form is those dicts)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


CUT = "…"  # what a value cut to fit the table ends with
WIDTH = 80  # every table fits a classic terminal; `--json` has the values uncut


def _is_number(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _table(title: str, columns: list[tuple[str, str]], rows: list[dict[str, Any]], caption: str = "") -> Table:
    # Errors are sentences: they go under the table, whole and wrapped, after the row's first cell.
    errors = [f"{_fmt(row.get(columns[0][1]))}: {row['error']}" for row in rows if row.get("error")]
    columns = [(h, k) for h, k in columns if k != "error"]
    caption = "\n".join(x for x in (caption, *errors) if x)
    # No padding: the box's blank separator leaves one space between columns, so a dozen fit.
    t = Table(title=title, caption=caption or None, expand=False, box=box.SIMPLE_HEAD, title_justify="left",
              caption_justify="left", caption_style="red" if errors else None, padding=0, show_edge=False,
              pad_edge=False)
    widest = {k: max([len(h)] + [len(_fmt(row.get(k))) for row in rows]) for h, k in columns}
    numeric = {k for _, k in columns if all(_is_number(row.get(k)) for row in rows)}
    # Numbers keep their full width: folding 10922 over two lines read as "1092". Text columns
    # (ids, states) share what is left of WIDTH, each at least 6 wide, and end in "…" where
    # they are cut.
    text = [k for _, k in columns if k not in numeric]
    floor = {k: widest[k] if widest[k] <= 10 else 6 for k in text}  # short states ("offloaded") stay whole
    left = WIDTH - sum(widest[k] for k in numeric) - (len(columns) - 1) - sum(floor.values())
    extra = sum(widest[k] - floor[k] for k in text) or 1
    width = {k: floor[k] + max(0, left) * (widest[k] - floor[k]) // extra for k in text}
    for header, key in columns:
        if key in numeric:
            t.add_column(header, justify="right", no_wrap=True, min_width=widest[key])
        elif any(" " in _fmt(row.get(key)) for row in rows):
            # Lists and sentences wrap between words, so each number in them stays whole.
            t.add_column(header, overflow="fold", min_width=min(6, widest[key]))
        else:
            t.add_column(header, overflow="ellipsis", no_wrap=True, max_width=min(widest[key], width[key]),
                         min_width=floor[key])
    for row in rows:
        t.add_row(*(Text(_fmt(row.get(key))) for _, key in columns))
    return t


def ls_table(doc: dict[str, Any]) -> Table:
    return _table(f"waiting requests: {doc['waiting']}", [
        ("entry", "entry_id"), ("request", "request_id"), ("age s", "age_s"), ("prompt tok", "prompt_tokens"),
        ("max tok", "max_tokens"), ("deliveries", "deliveries"), ("attempt", "attempt"),
        ("deadline in s", "deadline_in_s"), ("error", "error")], doc["requests"],
        caption=f"showing {doc['shown']} of {doc['waiting']}" if doc["shown"] < doc["waiting"] else "")


def inflight_table(doc: dict[str, Any]) -> Table:
    rows = [dict(r, progress_pct=None if r.get("progress") is None else round(100 * r["progress"], 1))
            for r in doc["requests"]]
    return _table(f"in flight: {doc['total']}", [
        ("worker", "worker"), ("request", "request_id"), ("age s", "age_s"), ("attempt", "attempt"),
        ("prompt tok", "prompt_tokens"), ("generated", "generated"), ("max tok", "max_tokens"),
        ("progress %", "progress_pct"), ("finish", "finish_reason"), ("error", "error")], rows)


def workers_table(doc: dict[str, Any]) -> Table:
    models = sorted({w["model"] for w in doc["workers"] if w.get("model")})
    return _table(f"workers: {doc['alive']} alive of {doc['total']}" + (f" (model {', '.join(models)})" if models else ""), [
        ("worker", "worker_id"), ("up", "alive"), ("hb s", "heartbeat_age_s"), ("run", "running"),
        ("wait", "waiting"), ("batch", "batch_size"), ("γ", "gamma"), ("draft", "draft_residency"),
        ("kv used", "kv_blocks_used"), ("kv free", "kv_blocks_free"), ("asgn", "assigned"),
        ("inbox", "inbox"), ("pol v", "policy_version"), ("error", "error")], doc["workers"],
        caption="up: heartbeat alive; hb s: its age; asgn: jobs assigned; pol v: policy version")


def _absent(doc: dict[str, Any], what: str, empty: str) -> Text:
    """A view with nothing to show: the decode error in red, or why it is empty in yellow."""
    return Text(f"no {what}: {doc['error']}" if doc["error"] else empty, style="red" if doc["error"] else "yellow")


def policy_view(doc: dict[str, Any]) -> Group | Text:
    pol = doc["policy"]
    if pol is None:
        return _absent(doc, "policy", "no policy published yet")
    head = Text(f"policy {pol['name']} v{pol['version']}, age {_fmt(pol['age_s'])} s, ttl {_fmt(pol['ttl_s'])} s"
                + ("  STALE (workers use their local default)" if pol["stale"] else ""),
                style="red" if pol["stale"] else "")
    buckets = _table("γ by batch size", [("batch size ≤", "max_batch_size"), ("γ", "gamma")], pol["buckets"])
    residency = _table("draft residency", [("worker", "worker"), ("residency", "residency")],
                       [{"worker": w, "residency": s} for w, s in pol["residency"].items()])
    return Group(head, buckets, residency)


def model_view(doc: dict[str, Any]) -> Group | Text:
    m = doc["model"]
    if m is None:
        return _absent(doc, "model", "no planner state saved yet")
    head = Text(f"{m['policy']} v{m['version']}, saved {_fmt(m['age_s'])} s ago, {m['updates']} steps learned, "
                f"{m['switches']} table switches; prefill {m['prefill_ms_per_token']} ms/token; "
                f"expected tokens per step by γ: {m['expected_tokens']}")
    # block: the bucket's schedule block (bins grow with it; a bucket stuck at 0 keeps exploring)
    rows = [{"batch": f"{b['batch_sizes'][0]}–{b['batch_sizes'][1]}", "mean": b["mean_batch"], "gamma": b["gamma"],
             "steps": f"{b['steps']} (block {b['block']})", "plays": " ".join(map(str, b["plays"])),
             "step": " ".join(f"{x:.1f}" for x in b.get("step_ms", ())) or "–",
             "loss": " ".join(f"{x:.2f}" for x in b.get("ms_per_token", ())) or "–"} for b in m["buckets"]]
    table = _table("per batch-size bucket (lists are γ = 0, 1, …)", [
        ("batch", "batch"), ("mean batch", "mean"), ("γ in force", "gamma"), ("steps", "steps"), ("plays by γ", "plays"),
        ("predicted step ms", "step"), ("predicted ms / token", "loss")], rows)
    return Group(head, table)


def stats_view(doc: dict[str, Any]) -> Group:
    head = Text(f"{doc['steps']} steps over {_fmt(doc['window_s'])} s; preempted {doc['preempted']} "
                f"({doc['preempted_tokens']} tokens to prefill again); "
                f"catch-ups {doc['catchup']['count']} ({doc['catchup']['tokens']} tokens, "
                f"mean {_fmt(doc['catchup']['mean_ms'])} ms); acceptance alarms {doc['acceptance_alarms']}",
                style="red" if doc["acceptance_alarms"] else "")
    acc = _table("acceptance per draft position", [("position", "position"), ("offered", "offered"),
                                                   ("accepted", "accepted"), ("rate", "rate")],
                 doc["acceptance_per_position"])
    by_gamma = _table("step time by γ", [
        ("γ", "gamma"), ("steps", "steps"), ("batch", "mean_batch_size"), ("mean ms", "mean_step_ms"),
        ("p50 ms", "p50_step_ms"), ("p90 ms", "p90_step_ms"), ("tok/step", "tokens_per_step"),
        ("ms/tok", "ms_per_token")], doc["by_gamma"])
    parts: list[Any] = [head, acc, by_gamma]
    if doc["errors"]:
        parts.append(_table("undecodable entries", [("entry", "entry_id"), ("error", "error")], doc["errors"]))
    return Group(*parts)


def dlq_table(doc: dict[str, Any]) -> Table:
    return _table(f"dead letters: {doc['count']}", [
        ("id", "id"), ("queue entry", "entry_id"), ("request", "request_id"), ("reason", "reason"),
        ("deliveries", "deliveries"), ("age s", "age_s"), ("bytes", "payload_bytes"), ("error", "error")],
        doc["dead_letters"])


def dashboard(doc: dict[str, Any]) -> Group:
    """Everything on one screen (``nightjar queue watch``)."""
    return Group(workers_table(doc["workers"]), ls_table(doc["queue"]), inflight_table(doc["inflight"]),
                 policy_view(doc["policy"]), stats_view(doc["stats"]), dlq_table(doc["dlq"]))
