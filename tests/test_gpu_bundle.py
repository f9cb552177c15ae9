"""The bundle for the lent GPU machine (mmpg/grouping/gpu_bundle.py, scripts/gpu_bundle.sh) and the rehearsal of the
GPU run (scripts/gpu_check.sh --rehearse). The fast tests download the wheels once into wheels/ (skipped, with the
reason, when the registry is unreachable) and prove the offline resolution real: it fails when a wheel is gone, when
a dependency's bound is one the image may not meet, and it rejects wheels nobody needs. The slow tests run the whole
rehearsal and the device mode on this CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mmpg.grouping import gpu_bundle

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "wheels"


@pytest.fixture(scope="module")
def bundle():
    """scripts/gpu_bundle.sh's output; wheels/ filled (downloads only what is missing)."""
    proc = subprocess.run(["bash", "scripts/gpu_bundle.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode == 2:
        pytest.skip(f"the wheels could not be fetched (registry unreachable?): {proc.stderr.strip()[-300:]}")
    return proc


def _copy(tmp_path, drop=()):
    folder = tmp_path / "wheels"
    folder.mkdir()
    for path in WHEELS.glob("*.whl"):
        if not any(path.name.startswith(d) for d in drop):
            shutil.copy(path, folder)
    return folder


def test_bundle_lists_every_wheel_and_fits(bundle):
    assert bundle.returncode == 0, bundle.stdout + bundle.stderr
    for w in gpu_bundle.BUNDLE:
        assert f"{w.name.replace('-', '_')}-{w.version}-" in bundle.stdout, w
    assert "bundle-list: ok" in bundle.stdout and "of 64 MiB" in bundle.stdout
    assert (WHEELS / "synth" / "train.json").exists()
    pure = gpu_bundle.wheel_files(WHEELS)["deepspeed"].name
    assert pure.endswith("-py3-none-any.whl")  # built here from the sdist: must not be tied to Python 3.11


def test_resolution_is_complete_and_exact(bundle):
    lines, problems = gpu_bundle.check_bundle(WHEELS)
    assert problems == [], problems
    listed = "\n".join(lines)
    assert "pydantic-core==2.23.4" in listed and "typing-extensions==4.10.0" in listed and "av==0" in listed


def test_resolution_fails_when_a_wheel_is_gone(bundle, tmp_path, monkeypatch):
    """A dependency nobody listed: pydantic-core dropped from the folder and from BUNDLE, so only pip's
    resolution can notice."""
    folder = _copy(tmp_path, drop=("pydantic_core",))
    monkeypatch.setattr(gpu_bundle, "BUNDLE", [w for w in gpu_bundle.BUNDLE if w.name != "pydantic-core"])
    resolved, error = gpu_bundle.resolve(folder)
    assert resolved == [] and "pydantic-core==2.23.4" in error and "No matching distribution" in error
    problems = gpu_bundle.check_bundle(folder)[1]
    assert any("pip cannot install the bundle offline" in p for p in problems)


def test_resolution_fails_on_a_bound_the_image_may_not_meet(bundle, monkeypatch):
    """pydantic 2.9.2 needs typing-extensions >= 4.6.1; were the image known only to have 4.0, pip must refuse."""
    monkeypatch.setitem(gpu_bundle.IMAGE_FLOORS, "typing-extensions", ("4.0", "hypothetical"))
    resolved, error = gpu_bundle.resolve(WHEELS)
    assert resolved == [] and "typing-extensions" in error


def test_unneeded_and_shadowing_wheels_are_problems(bundle, tmp_path):
    folder = _copy(tmp_path)
    gpu_bundle._stub_wheel(folder, "unrelated-thing", "1.0")
    gpu_bundle._stub_wheel(folder, "numpy", "2.5.2")
    problems = gpu_bundle.check_bundle(folder)[1]
    assert any("unrelated_thing-1.0-py3-none-any.whl: not needed" in p for p in problems), problems
    assert any("the image already has numpy" in p for p in problems), problems


def test_size_limit(monkeypatch, tmp_path):
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "blob").write_bytes(b"x" * 4096)
    lines, fits = gpu_bundle.size_lines(ROOT, [tmp_path / "big"])
    assert fits and "of 64 MiB" in lines[-1]
    monkeypatch.setattr(gpu_bundle, "LIMIT_BYTES", 1024)
    lines, fits = gpu_bundle.size_lines(ROOT, [tmp_path / "big"])
    assert not fits and "TOO LARGE" in lines[-1]


def test_device_side_requirement_check(tmp_path):
    info = tmp_path / "fake_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-pkg\nVersion: 1.0\nRequires-Dist: numpy>=999\n"
                                   "Requires-Dist: surely-not-installed-pkg\nRequires-Dist: av\n"
                                   "Requires-Dist: sphinx; extra == 'docs'\n")
    problems = gpu_bundle.deps_problems(tmp_path)
    assert len(problems) == 2, problems  # av is EXCLUDED, the extra is not asked for
    assert "numpy>=999: found" in problems[0] and "surely-not-installed-pkg: not installed" in problems[1]


def test_import_audit(tmp_path):
    log = tmp_path / "imports.tsv"
    log.write_text("torch\tmmpg.train.engine\nomegaconf\tmmpg.config\njson\tmmpg.x\nbatches\ttest_x\n"
                   "pytest_xdist_is_not_a_module\tmmpg.y\n")
    lines, problems = gpu_bundle.audit_problems(log, ROOT)
    assert problems == ["mmpg.y imports pytest_xdist_is_not_a_module, which no installed distribution provides"]
    assert "omegaconf (bundle)" in lines[0] and "torch (image)" in lines[0]


@pytest.mark.slow
def test_rehearsal(bundle, tmp_path):
    """The whole run on this CPU: the bundle resolved for the image, the GPU rows NOT RUN with their reason, the
    CPU counterparts, the four training runs and the tiny bench PASS (about 3 minutes on 2 cores)."""
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "device bench run bench-model-P8192" in proc.stdout and "stage tests-grouped (limit 120 s)" in proc.stdout
    rows = {r["path"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert rows["bundle complete for the image (pip resolves it offline for cp312)"]["status"] == "PASS"
    assert rows["grouped flex forward + backward, release heads"]["status"] == "NOT RUN"
    assert "needs a CUDA device" in rows["grouped flex forward + backward, release heads"]["detail"]
    assert all(rows[f"mmpg train {n.replace('-', ' ')} (one process)"]["status"] == "PASS"
               for n in ("bf16-zero0-grouped", "bf16-zero0-repeated", "bf16-zero3-grouped", "bf16-zero3-repeated"))
    assert rows["bench model P=48 S=6 G=3"]["status"] == "PASS"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-tiny.json", "gpu_check.json", "gpu_check.log",
                                                          "gpu_check.md"]


@pytest.mark.slow
def test_device_mode_without_a_gpu(bundle, tmp_path):
    """The device run on this CPU (the project's Python standing in for the image's, two pure wheels): it installs
    with --no-index --no-deps --target, checks their requirements, finds no GPU, reports every GPU stage NOT RUN
    and exits 3."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in ("hjson", "omegaconf"):
        shutil.copy(gpu_bundle.wheel_files(WHEELS)[name], folder)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MMPG_GPU_WHEELS": str(folder), "TMPDIR": str(tmp_path),
           "MMPG_GPU_CHECK_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 3, proc.stdout[-3000:]
    rows = {r["path"]: r for r in json.loads((tmp_path / "out" / "gpu_check.json").read_text())["rows"]}
    assert rows["bundle installed offline (pip --no-index --no-deps --target)"]["status"] == "PASS"
    assert rows["bundle requirements met by the image"]["status"] == "PASS"
    assert rows["CUDA device"]["status"] == "NOT RUN"
    assert rows["grouped sdpa, masked CUDA path, tiny models"]["detail"].startswith("no usable GPU")
