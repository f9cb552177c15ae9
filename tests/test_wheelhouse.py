"""The wheelhouse for an air-gapped GPU node (mmpg/doctor/wheelhouse.py, scripts/wheelhouse.sh), offline: the
platform tags pip must be given, what the node has already, and the offline resolution that proves a wheelhouse
complete, failing (and naming the package) on a missing dependency and on a bound the node's version does not meet."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mmpg.doctor import wheelhouse

ROOT = Path(__file__).resolve().parents[1]


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A pure-Python wheel holding only its metadata (and its requirements)."""
    base = f"{name}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                  for r in requires)
    files = {f"{base}.dist-info/METADATA": meta,
             f"{base}.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{base}.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{base}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{base}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_platform_tags_cover_older_glibc_and_aliases():
    tags = wheelhouse.platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "manylinux1_x86_64"
    assert "manylinux2014_x86_64" in tags and "manylinux_2_29_x86_64" not in tags
    assert "manylinux2014_aarch64" in wheelhouse.platforms("manylinux_2_17_aarch64")
    flags = wheelhouse.pip_flags("3.12", "manylinux_2_28_x86_64")
    assert flags[:3] == ["--only-binary=:all:", "--python-version", "3.12"] and "cp312" in flags
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        wheelhouse.pip_flags("312", "manylinux_2_28_x86_64")


def test_what_the_node_has_is_not_fetched(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Torch==2.11.0\n-e git+https://example.org/x#egg=x\npeft==0.21.2\n# comment\nqwen_vl_utils==0.0.14\n")
    have = wheelhouse.read_have(str(freeze))
    assert have == {"torch": "2.11.0", "peft": "0.21.2", "qwen-vl-utils": "0.0.14"}
    reqs = [wheelhouse.norm(r.split(">")[0].split("=")[0].split("<")[0]) for r in wheelhouse.requirements(have)]
    assert "deepspeed" in reqs and "transformers" in reqs
    assert not {"torch", "torchvision", "peft", "qwen-vl-utils"} & set(reqs)
    assert wheelhouse.node_packages(have, with_torch=False)["torch"] == "2.11.0"  # --have wins over this machine


def test_offline_resolution_names_what_is_missing(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    _wheel(house, "app_x", "1.0", ("lib-y>=2", "base-z>=1.5"))
    _wheel(house, "lib_y", "2.1")
    resolved, error = wheelhouse.check(house, "3.12", "manylinux_2_28_x86_64", {"base-z": "1.6"}, ["app_x"])
    assert error == "", error
    assert "lib_y==2.1" in resolved and "base-z==1.6  (the node has it)" in resolved
    # the node's base-z is older than app_x allows: named
    resolved, error = wheelhouse.check(house, "3.12", "manylinux_2_28_x86_64", {"base-z": "1.0"}, ["app_x"])
    assert resolved == [] and "base-z" in error
    # a dependency nobody fetched: named
    (house / "lib_y-2.1-py3-none-any.whl").unlink()
    resolved, error = wheelhouse.check(house, "3.12", "manylinux_2_28_x86_64", {"base-z": "1.6"}, ["app_x"])
    assert resolved == [] and "lib-y" in error.lower().replace("_", "-")


def test_bad_python_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "mmpg.doctor.wheelhouse", "check", "--python", "3", "--platform",
                           "manylinux_2_28_x86_64", "--out", "x"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "give the node's Python as MAJOR.MINOR" in proc.stderr
