"""`nightjar queue` against a known Redis state, JSON compared field by field: on a real
redis-server, and again on a real Redis Cluster through a ``redis+cluster://`` URL (``any_redis``)."""

from __future__ import annotations

import io
import json
import time

import pytest

from nightjar.keys import Keys
from nightjar.messages import DeadLetter, Heartbeat, Job, OutputChunk, Policy, PolicyHold, StepStats
from nightjar.service_util import connect_redis_sync
from nightjar_tools.queue_tool import main
from planner_svc.policies.base import bucket_index


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def r(any_redis):
    client = connect_redis_sync(any_redis[0])
    yield client
    client.close()


@pytest.fixture
def keys(any_redis) -> Keys:
    return Keys(any_redis[1])


@pytest.fixture
def q(any_redis):
    """Run `nightjar queue ARGS --json` and return (exit code, parsed JSON); every test taking it
    runs on one redis-server and again on a Redis Cluster URL (``any_redis``)."""
    redis_url, key_prefix = any_redis

    def run(*args: str, json_out: bool = True):
        out = io.StringIO()
        argv = [*args, "--redis-url", redis_url, "--prefix", key_prefix] + (["--json"] if json_out else [])
        code = main(argv, out=out)
        text = out.getvalue()
        return code, (json.loads(text) if json_out and text.strip() else text)

    return run


def job(rid: str, n_prompt: int, max_tokens: int, enq_ms: int, attempt: int = 0, deadline: int = 0) -> Job:
    return Job(request_id=rid, prompt_token_ids=tuple(range(n_prompt)), params={"max_tokens": max_tokens},
               enqueued_unix_ms=enq_ms, attempt=attempt, deadline_unix_ms=deadline)


def test_ls_waiting_requests_with_deliveries_and_a_bad_entry(r, keys, q):
    t = now_ms()
    r.xgroup_create(keys.requests, keys.scheduler_group, id="0", mkstream=True)
    e1 = r.xadd(keys.requests, {b"job": job("a", 5, 16, t - 4000).encode()}).decode()
    e2 = r.xadd(keys.requests, {b"job": job("b", 9, 32, t - 1000, attempt=1, deadline=t + 30_000).encode()}).decode()
    e3 = r.xadd(keys.requests, {b"job": b"\xc1garbage"}).decode()
    # The scheduler read the first entry twice (two consumers) without acknowledging it.
    r.xreadgroup(keys.scheduler_group, "c1", {keys.requests: ">"}, count=1)
    r.xclaim(keys.requests, keys.scheduler_group, "c2", 0, [e1])

    code, doc = q("ls")
    assert code == 0
    assert (doc["waiting"], doc["shown"]) == (3, 3)
    a, b, bad = doc["requests"]
    assert (a["entry_id"], a["request_id"], a["prompt_tokens"], a["max_tokens"], a["deliveries"], a["attempt"],
            a["deadline_in_s"], a["error"]) == (e1, "a", 5, 16, 2, 0, None, None)
    assert a["age_s"] == pytest.approx(4.0, abs=1.0)
    assert (b["entry_id"], b["request_id"], b["prompt_tokens"], b["max_tokens"], b["deliveries"], b["attempt"]) == \
        (e2, "b", 9, 32, 0, 1)
    assert b["deadline_in_s"] == pytest.approx(30.0, abs=1.0) and b["age_s"] == pytest.approx(1.0, abs=1.0)
    assert bad["entry_id"] == e3 and bad["request_id"] is None and "msgpack" in bad["error"]

    code, text = q("ls", json_out=False)  # the table view renders the same rows, error included
    assert code == 0 and "waiting requests: 3" in text and "msgpack" in text


def test_inflight_shows_progress_per_worker(r, keys, q):
    t = now_ms()
    r.sadd(keys.workers, "w1", "w2")
    for rid, worker, n, max_tokens, generated, finish in (("r1", "w1", 4, 20, 5, None), ("r2", "w1", 3, 10, 10, "length"),
                                                          ("r3", "w2", 7, 8, 0, None)):
        r.hset(keys.assignment(rid), mapping={b"worker": worker, b"job": job(rid, n, max_tokens, t).encode(),
                                              b"assigned_unix_ms": t - 2000})
        r.sadd(keys.worker_assignments(worker), rid)
        if generated:
            r.xadd(keys.output(rid), {b"c": OutputChunk(request_id=rid, index=0, token_ids=(1, 2)).encode()})
            r.xadd(keys.output(rid), {b"c": OutputChunk(request_id=rid, index=2, token_ids=tuple(range(generated - 2)),
                                                         finish_reason=finish).encode()})
    r.sadd(keys.worker_assignments("w2"), "ghost")  # set entry without a record
    r.hset(keys.assignment("bad"), mapping={b"worker": "w2", b"job": b"nope", b"assigned_unix_ms": t})
    r.sadd(keys.worker_assignments("w2"), "bad")

    code, doc = q("inflight")
    assert code == 0 and doc["total"] == 5
    rows = {row["request_id"]: row for row in doc["requests"]}
    r1, r2, r3 = rows["r1"], rows["r2"], rows["r3"]
    assert (r1["worker"], r1["prompt_tokens"], r1["max_tokens"], r1["generated"], r1["progress"], r1["finish_reason"]) == \
        ("w1", 4, 20, 5, 0.25, None)
    assert r1["age_s"] == pytest.approx(2.0, abs=1.0)
    assert (r2["generated"], r2["progress"], r2["finish_reason"]) == (10, 1.0, "length")
    assert (r3["worker"], r3["generated"], r3["progress"], r3["error"]) == ("w2", 0, 0.0, None)
    assert "missing" in rows["ghost"]["error"]
    assert rows["bad"]["error"].startswith("job:")


def test_workers_with_heartbeats_and_last_batch(r, keys, q):
    t = now_ms()
    r.sadd(keys.workers, "w1", "dead")
    r.set(keys.heartbeat("w1"), Heartbeat(worker_id="w1", unix_ms=t - 500, model="tiny-target", kv_blocks_free=30,
                                          kv_blocks_total=100, running=6, waiting=2, max_running=64, gamma=3,
                                          draft_residency="resident", policy_version=7,
                                          started_unix_ms=t - 60_000).encode(), px=10_000)
    r.set(keys.heartbeat("w9"), b"junk", px=10_000)  # alive but undecodable, not in the set
    r.sadd(keys.worker_assignments("w1"), "x", "y")
    r.xadd(keys.inbox("w1"), {b"job": job("x", 1, 1, t).encode()})
    r.xadd(keys.stats, {b"s": _step("w1", batch=5).encode()})
    r.xadd(keys.stats, {b"s": _step("w1", batch=6).encode()})

    code, doc = q("workers")
    assert code == 0 and (doc["total"], doc["alive"]) == (3, 2)
    w = {row["worker_id"]: row for row in doc["workers"]}
    w1 = w["w1"]
    expected = dict(alive=True, model="tiny-target", running=6, waiting=2, max_running=64, gamma=3,
                    draft_residency="resident", kv_blocks_free=30, kv_blocks_total=100, kv_blocks_used=70,
                    policy_version=7, assigned=2, inbox=1, batch_size=6, error=None)
    assert {k: w1[k] for k in expected} == expected
    assert w1["heartbeat_age_s"] == pytest.approx(0.5, abs=1.0) and w1["uptime_s"] == pytest.approx(60, abs=1.5)
    assert w["dead"]["alive"] is False and w["dead"]["error"] is None
    assert w["w9"]["alive"] is True and w["w9"]["error"].startswith("heartbeat:")


def _step(worker: str, batch: int = 4, gamma: int = 2, acc=(4, 2), step_ms: float = 10.0, emitted: int = 10,
          catchup_tokens: int = 0, catchup_ms: float = 0.0, unix_ms: int = 0, preempted: int = 0,
          preempted_tokens: int = 0) -> StepStats:
    return StepStats(worker_id=worker, step=1, unix_ms=unix_ms or now_ms(), batch_size=batch, gamma=gamma, draft_ms=1.0,
                     verify_ms=2.0, step_ms=step_ms, accepted_per_position=acc, emitted_tokens=emitted,
                     catchup_tokens=catchup_tokens, catchup_ms=catchup_ms, preempted=preempted,
                     preempted_tokens=preempted_tokens)


def test_policy(r, keys, q):
    code, doc = q("policy")
    assert (code, doc) == (0, {"policy": None, "error": None})
    t = now_ms()
    r.set(keys.policy, Policy(version=12, unix_ms=t - 3000, ttl_s=60.0, bucket_upper_bounds=(1, 8, 64),
                              gamma_by_bucket=(4, 2, 0), residency={"w2": "offloaded", "w1": "resident"},
                              name="nightjar").encode())
    code, doc = q("policy")
    pol = doc["policy"]
    assert (pol["version"], pol["name"], pol["ttl_s"], pol["stale"]) == (12, "nightjar", 60.0, False)
    assert pol["age_s"] == pytest.approx(3.0, abs=1.0)
    assert pol["buckets"] == [{"max_batch_size": 1, "gamma": 4}, {"max_batch_size": 8, "gamma": 2},
                              {"max_batch_size": 64, "gamma": 0}]
    assert pol["residency"] == {"w1": "resident", "w2": "offloaded"}
    code, text = q("policy", json_out=False)
    assert "v12" in text and "offloaded" in text
    r.set(keys.policy, b"\x00")
    code, doc = q("policy")
    assert code == 0 and doc["policy"] is None and doc["error"]


def test_stats_acceptance_per_position_and_time_by_gamma(r, keys, q):
    t = now_ms()
    r.xadd(keys.stats, {b"s": _step("w1", batch=4, gamma=2, acc=(4, 2), step_ms=10, emitted=10, unix_ms=t - 2000).encode()})
    r.xadd(keys.stats, {b"s": _step("w1", batch=2, gamma=2, acc=(1, 0), step_ms=20, emitted=3, catchup_tokens=50,
                                    catchup_ms=8.0, unix_ms=t - 1000).encode()})
    r.xadd(keys.stats, {b"s": _step("w1", batch=8, gamma=0, acc=(), step_ms=6, emitted=8, unix_ms=t, preempted=2,
                                    preempted_tokens=75).encode()})
    r.xadd(keys.stats, {b"s": b"bad"})
    code, doc = q("stats")
    assert code == 0 and doc["steps"] == 3 and doc["window_s"] == pytest.approx(2.0)
    assert doc["acceptance_per_position"] == [
        {"position": 0, "offered": 6, "accepted": 5, "rate": 0.833},
        {"position": 1, "offered": 6, "accepted": 2, "rate": 0.333},
    ]
    g0, g2 = doc["by_gamma"]
    assert (g0["gamma"], g0["steps"], g0["mean_step_ms"], g0["tokens_per_step"], g0["ms_per_token"]) == (0, 1, 6.0, 8.0, 0.75)
    assert (g2["gamma"], g2["steps"], g2["mean_batch_size"], g2["mean_step_ms"], g2["tokens_per_step"]) == (2, 2, 3.0, 15.0, 6.5)
    assert doc["catchup"] == {"count": 1, "tokens": 50, "mean_ms": 8.0}
    assert (doc["preempted"], doc["preempted_tokens"]) == (2, 75)
    code, text = q("stats", json_out=False)
    assert code == 0 and "preempted 2 (75 tokens to prefill again)" in text
    assert len(doc["errors"]) == 1 and doc["errors"][0]["error"]


def _dead_letter(r, keys, rid: str | None, reason: str = "delivered 6 times (max 5)") -> str:
    t = now_ms()
    raw = job(rid, 3, 4, t).encode() if rid else b"\xc1\xc1"
    dl = DeadLetter(entry_id="1-0", reason=reason, deliveries=6, payload=raw, unix_ms=t - 1000)
    return r.xadd(keys.dead_letters, {b"dl": dl.encode()}).decode()


def test_dlq_list_requeue_and_purge(r, keys, q):
    good = _dead_letter(r, keys, "poison-1")
    bad = _dead_letter(r, keys, None, reason="not valid msgpack")
    r.xadd(keys.output("poison-1"), {b"c": OutputChunk(request_id="poison-1", index=0, finish_reason="error").encode()})
    code, doc = q("dlq")
    assert code == 0 and (doc["count"], doc["shown"]) == (2, 2)
    g, b = doc["dead_letters"]
    assert (g["id"], g["entry_id"], g["request_id"], g["reason"], g["deliveries"], g["requeueable"], g["error"]) == \
        (good, "1-0", "poison-1", "delivered 6 times (max 5)", 6, True, None)
    assert g["age_s"] == pytest.approx(1.0, abs=1.0)
    assert (b["id"], b["requeueable"], b["request_id"]) == (bad, False, None) and b["error"].startswith("payload:")

    # Without --yes nothing changes, and the exit code says so.
    code, res = q("dlq", "requeue", good)
    assert code == 2 and res["dry_run"] is True and res["request_id"] == "poison-1"
    assert r.xlen(keys.dead_letters) == 2 and r.xlen(keys.requests) == 0
    code, text = q("dlq", "requeue", good, json_out=False)
    assert code == 2 and "add --yes" in text

    code, res = q("dlq", "requeue", good, "--yes")
    assert code == 0 and res["dry_run"] is False and res["request_id"] == "poison-1"
    assert r.xlen(keys.dead_letters) == 1 and r.xlen(keys.requests) == 1
    entry_id, fields = r.xrange(keys.requests)[0]
    assert entry_id.decode() == res["requests_entry_id"] and Job.decode(fields[b"job"]).request_id == "poison-1"
    assert not r.exists(keys.output("poison-1"))  # the stale error output went with it

    code, res = q("dlq", "requeue", bad, "--yes")  # undecodable payload: refused, kept
    assert code == 2 and "purge" in res["error"] and r.xlen(keys.dead_letters) == 1
    code, res = q("dlq", "requeue", "999-0", "--yes")
    assert code == 2 and "no dead letter" in res["error"]

    code, res = q("dlq", "purge")
    assert code == 2 and res["would_purge"] == 1 and r.xlen(keys.dead_letters) == 1
    code, text = q("dlq", "purge", "--yes", json_out=False)
    assert code == 0 and "purged 1 dead letters" in text and r.xlen(keys.dead_letters) == 0


def test_hold_sets_an_expiring_static_policy_for_the_planner_and_release_lifts_it(r, keys, q):
    code, res = q("hold", "fixed:2", "--for", "60")  # without --yes: nothing changes
    assert code == 2 and res["dry_run"] is True and r.get(keys.planner_hold) is None
    code, res = q("hold", "fixed:2", "--for", "60", "--yes")
    assert code == 0 and res == {"action": "hold", "policy": "fixed:2", "seconds": 60.0, "dry_run": False}
    assert PolicyHold.decode(r.get(keys.planner_hold)).policy == "fixed:2"
    assert 55_000 < r.pttl(keys.planner_hold) <= 60_000  # a forgotten hold ends by itself
    for bad, says in ((["nightjar"], "learns"), (["fixed:x"], "integer"), (["off", "--for", "0"], "--for")):
        code, res = q("hold", *bad, "--yes")
        assert code == 2 and says in res["error"], res
    assert PolicyHold.decode(r.get(keys.planner_hold)).policy == "fixed:2"  # refusals changed nothing
    code, text = q("hold", "fixed:2", "--release", json_out=False)
    assert code == 2 and "policy spec or --release" in text
    code, text = q("hold", "--release", "--yes", json_out=False)
    assert code == 0 and "released the hold on fixed:2" in text and r.get(keys.planner_hold) is None


def test_read_only_views_change_nothing(r, keys, q):
    t = now_ms()
    r.xadd(keys.requests, {b"job": job("a", 1, 1, t).encode()})
    _dead_letter(r, keys, "p")
    r.sadd(keys.workers, "w1")
    before = {k: r.dump(k) for k in r.scan_iter(match=keys.all_pattern)}
    for view in ("ls", "inflight", "workers", "policy", "stats", "model", "dlq"):
        assert q(view)[0] == 0
        assert q(view, json_out=False)[0] == 0
    assert q("watch", "--iterations", "2", "--interval-s", "0.01", json_out=False)[0] == 0
    after = {k: r.dump(k) for k in r.scan_iter(match=keys.all_pattern)}
    assert after == before


def test_watch_json_lines_and_dashboard(r, keys, q):
    r.xadd(keys.requests, {b"job": job("w-a", 2, 3, now_ms()).encode()})
    code, text = q("watch", "--iterations", "3", "--interval-s", "0.01", "--json", json_out=False)
    lines = [json.loads(x) for x in text.splitlines()]
    assert code == 0 and len(lines) == 3
    assert set(lines[0]) == {"queue", "inflight", "workers", "policy", "stats", "dlq"}
    assert lines[-1]["queue"]["requests"][0]["request_id"] == "w-a"
    code, text = q("watch", "--iterations", "2", "--interval-s", "0.01", json_out=False)
    assert code == 0 and "waiting requests: 1" in text and "workers" in text


def test_unreachable_redis_and_bad_flags(key_prefix):
    from nightjar_tools.redis_server import free_port

    out = io.StringIO()
    assert main(["ls", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--prefix", key_prefix], out=out) == 1
    assert main(["ls", "--redis-url", "http://x", "--prefix", key_prefix], out=out) == 2
    assert main(["ls", "--redis-url", "redis://127.0.0.1:1/0", "--tls-ca", "/ca.pem"], out=out) == 2


def test_password_flag(key_prefix):
    from nightjar_tools.redis_server import EmbeddedRedis

    with EmbeddedRedis(password="pw-123") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        out = io.StringIO()
        assert main(["ls", "--redis-url", url, "--prefix", key_prefix, "--json"], out=out) == 1  # no password
        out = io.StringIO()
        assert main(["ls", "--redis-url", url, "--redis-password", "pw-123", "--prefix", key_prefix, "--json"],
                    out=out) == 0
        assert json.loads(out.getvalue())["waiting"] == 0


def test_every_view_has_help_with_defaults(capsys):
    for view in ("ls", "inflight", "workers", "policy", "stats", "model", "dlq", "hold", "watch"):
        with pytest.raises(SystemExit) as exc:
            main([view, "--help"])
        assert exc.value.code == 0
        assert "(default:" in capsys.readouterr().out


def test_connect_tls_and_password_options():
    import redis.connection

    from nightjar_tools.queue_tool.cli import connect

    plain = connect("redis://127.0.0.1:6379/0")
    assert plain.connection_pool.connection_class is redis.connection.Connection
    tls = connect("redis://127.0.0.1:6379/0", password="pw", tls=True, tls_ca="/etc/ca.pem")
    kw = tls.connection_pool.connection_kwargs
    assert tls.connection_pool.connection_class is redis.connection.SSLConnection
    assert (kw["password"], kw["ssl_ca_certs"]) == ("pw", "/etc/ca.pem")
    with pytest.raises(ValueError, match="--tls"):
        connect("redis://127.0.0.1:6379/0", tls_ca="/etc/ca.pem")


def test_error_messages_never_show_the_password(capsys):
    from nightjar_tools.queue_tool.cli import masked
    from nightjar_tools.redis_server import free_port

    assert masked("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert masked("rediss://user:s3cret@host:6379/0") == "rediss://user:***@host:6379/0"
    assert masked("redis://host:6379/0") == "redis://host:6379/0"
    assert main(["ls", "--redis-url", f"redis://:s3cret@127.0.0.1:{free_port()}/0"], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "cannot reach Redis" in err and "s3cret" not in err


def test_cluster_url_flags_and_errors(capsys):
    """A cluster URL: --tls makes it rediss+cluster://, an untagged prefix is refused as the
    services refuse it (exit 2), and a cluster that no seed answers for is exit 1 without the
    password (the cluster client connects when it is made, not at the first command)."""
    from nightjar_tools.queue_tool.cli import connection_args
    from nightjar_tools.redis_server import free_port

    url, kw = connection_args("redis+cluster://:pw@a:7000,b:7001", tls=True, tls_ca="/ca.pem", key_prefix="{nj}")
    assert url == "rediss+cluster://:pw@a:7000,b:7001" and kw["ssl_ca_certs"] == "/ca.pem"
    with pytest.raises(ValueError, match="--tls"):
        connection_args("redis+cluster://a:7000", tls_ca="/ca.pem")

    assert main(["ls", "--redis-url", "redis+cluster://127.0.0.1:7000", "--prefix", "nj"], out=io.StringIO()) == 2
    assert "hash tag such as '{nj}'" in capsys.readouterr().err
    url = f"redis+cluster://:s3cret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    assert main(["ls", "--redis-url", url, "--prefix", "{nj}"], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "cannot reach Redis at redis+cluster://:***@" in err and "s3cret" not in err


def test_model_shows_what_the_planner_learned(r, keys, q):
    from planner_svc.config import PlannerConfig
    from planner_svc.policies import make_policy
    from planner_svc.service import encode_state

    assert q("model") == (0, {"model": None, "error": None})
    cfg = PlannerConfig(policy="nightjar", gamma_max=3)
    policy = make_policy("nightjar", gamma_max=3, buckets=cfg.buckets)
    for i in range(300):  # a step costs 5 ms + 0.5 ms per verified token, + 1 ms per draft pass
        b, g = 1 + i % 12, i % 4
        policy.update(StepStats(worker_id="w", step=i, unix_ms=now_ms(), batch_size=b, gamma=g, draft_ms=1.0 * g,
                                verify_ms=5.0 + 0.5 * b * (g + 1), step_ms=0.0, accepted_per_position=(b,) * g,
                                emitted_tokens=b * (g + 1)))
    r.set(keys.planner_state, encode_state(cfg, 7, policy))
    code, doc = q("model")
    m = doc["model"]
    assert code == 0 and (m["policy"], m["version"], m["gamma_max"], m["updates"]) == ("nightjar", 7, 3, 300)
    assert m["expected_tokens"] == pytest.approx([1, 2, 3, 4], abs=0.05)  # every draft was accepted
    assert [b["gamma"] for b in m["buckets"]] == list(policy.table())
    row = m["buckets"][bucket_index(cfg.buckets, 8)]
    assert row["batch_sizes"][0] <= row["mean_batch"] <= row["batch_sizes"][1] and sum(row["plays"]) == row["steps"]
    step = row["step_ms"]
    assert step == sorted(step) and step[0] == pytest.approx(5.0 + 0.5 * row["mean_batch"], rel=0.15)
    code, text = q("model", json_out=False)
    assert code == 0 and "nightjar v7" in text and "predicted ms / token" in text
    assert m["switches"] == policy.switches and m["prefill_ms_per_token"] == 0.0  # no step carried a prefill
    assert [b["block"] for b in m["buckets"]] == [t.block for t in policy.timelines] and f"(block {row['block']})" in text
    r.set(keys.planner_state, b"\xc1")  # not msgpack: a clear error, not a crash
    assert q("model")[1]["model"] is None and "unreadable" in q("model")[1]["error"]
    r.set(keys.planner_state, encode_state(PlannerConfig(policy="fixed:2", gamma_max=3), 1,
                                           make_policy("fixed:2", gamma_max=3)))
    assert "no step-cost model" in q("model")[1]["error"]


def _render80(renderable) -> list[str]:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=80, color_system=None, soft_wrap=False).print(renderable)
    return out.getvalue().splitlines()


def test_tables_fit_80_columns_and_never_cut_numbers():
    from nightjar_tools.queue_tool import render

    doc = {"alive": 2, "total": 2, "workers": [
        dict(worker_id="gpu-host-0123456789-worker-with-a-long-id", alive=True, heartbeat_age_s=0.42, running=64,
             waiting=123, batch_size=64, gamma=4, draft_residency="offloaded", kv_blocks_used=54321,
             kv_blocks_free=10922, assigned=187, inbox=12, policy_version=12345, model="tiny-target", error=None),
        dict(worker_id="w2", alive=False, heartbeat_age_s=None, running=0, waiting=0, batch_size=None, gamma=0,
             draft_residency="resident", kv_blocks_used=0, kv_blocks_free=99999, assigned=0, inbox=0,
             policy_version=None, model="tiny-target", error="heartbeat: undecodable entry of 57 bytes " * 2)]}
    lines = _render80(render.workers_table(doc))
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    for number in ("10922", "54321", "99999", "12345", "187"):
        assert number in text, text  # whole, on one line
    assert "pol v" in text and "offloaded" in text
    assert render.CUT in text  # the long worker id is cut, and says so
    assert "gpu-host" in text

    inflight = {"total": 1, "requests": [dict(worker="gpu-host-0123456789", request_id="f" * 32, age_s=1234.5,
                                              attempt=1, prompt_tokens=32000, generated=16384, max_tokens=32768,
                                              progress=0.5, finish_reason=None, error=None)]}
    lines = _render80(render.inflight_table(inflight))
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert all(n in "\n".join(lines) for n in ("32000", "16384", "32768", "1234"))
