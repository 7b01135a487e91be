import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    for pkg in ("nightjar/v1", "nightjar_client/_v1"):
        for name in ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"):
            fresh, committed = tmp_path / pkg / name, ROOT / pkg / name
            assert filecmp.cmp(fresh, committed, shallow=False), f"{pkg}/{name} is stale: run scripts/gen_proto.sh"
    assert "from . import inference_pb2" in (ROOT / "nightjar_client/_v1/inference_pb2_grpc.py").read_text()
