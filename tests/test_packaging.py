"""mmpg as a wheel installs it (`pip install mmpg` from a wheelhouse, scripts/wheelhouse.sh): every package of mmpg/
is in it, the inspector's sources (app/) are in it as the package mmpg_app, and nothing installs as a top-level `app`,
which would shadow any `app` of the user's; installed on its own, what `mmpg inspect` imports comes from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_mmpg_and_the_inspector_as_mmpg_app(tmp_path):
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("mmpg", "app"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = ["pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist")]
    proc = subprocess.run([sys.executable, "-m", *build, str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("mmpg-*.whl")))
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"mmpg", "mmpg_app"}
    assert {p.relative_to(ROOT / "app").as_posix() for p in (ROOT / "app").rglob("*.py")} == {
        n.split("/", 1)[1] for n in names if n.startswith("mmpg_app/")}
    folders = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "mmpg").rglob("*.py")}
    assert folders == {n.rsplit("/", 1)[0] for n in names if n.startswith("mmpg/") and n.endswith(".py")}

    site = tmp_path / "site"  # a wheel's files are the installed tree; run from another folder than the repository
    wheel.extractall(site)
    code = "import mmpg.cli, mmpg_app.server; print(mmpg.cli.__file__); print(mmpg_app.server.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(site / "mmpg" / "cli.py"), str(site / "mmpg_app" / "server.py")]
