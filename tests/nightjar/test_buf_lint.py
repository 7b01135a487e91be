"""`buf lint` on proto/ (rules in buf.yaml: STANDARD + COMMENTS).

buf comes from the npm package @bufbuild/buf, installed once into the git-ignored
.cache/buf. The test fails if buf reports anything; it skips only when npm itself is absent.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF_VERSION = "1.75.0"
PREFIX = ROOT / ".cache" / "buf"
BUF = PREFIX / "node_modules" / ".bin" / "buf"


def _buf() -> Path:
    if BUF.exists():
        out = subprocess.run([str(BUF), "--version"], capture_output=True, text=True, timeout=60)
        if out.stdout.strip() == BUF_VERSION:
            return BUF
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot fetch @bufbuild/buf (install Node.js to run buf lint)")
    subprocess.run([npm, "install", "--prefix", str(PREFIX), "--no-audit", "--no-fund", f"@bufbuild/buf@{BUF_VERSION}"],
                   check=True, capture_output=True, timeout=600)
    assert BUF.exists(), "npm installed @bufbuild/buf but its buf binary is missing"
    return BUF


def test_buf_lint_is_clean():
    result = subprocess.run([str(_buf()), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"buf lint found problems:\n{result.stdout}{result.stderr}"
