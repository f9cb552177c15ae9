"""A wheelhouse for an air-gapped GPU node: every wheel mmpg needs there, for the node's Python version and platform,
downloaded on a machine that reaches a registry, and the proof, made before anything is copied, that the node can
install from it offline.

    python -m mmpg.doctor.wheelhouse build --python 3.12 --platform manylinux_2_28_x86_64 --out DIR [--have FILE]
    python -m mmpg.doctor.wheelhouse check --python 3.12 --platform manylinux_2_28_x86_64 --out DIR [--have FILE]
    (scripts/wheelhouse.sh runs both)

What goes in: mmpg's own requirements (its package metadata, extras left out) and a wheel of mmpg itself, minus what
the node has already (`--have`: the node's `pip freeze`, `name==version` lines; torch and torchvision, whose CUDA
build comes from the node's own index, are left out unless `--with-torch`). Wheels only (`pip download
--only-binary=:all: --python-version --platform --implementation cp --abi`); a requirement with only an sdist on the
registry (DeepSpeed) is built here with `pip wheel` (its ops JIT-built on first use), and must come out pure Python
(`py3-none-any`), else it would not fit another Python.

The proof (`check`): pip resolves the install of those requirements for that Python and platform with no index,
against the wheelhouse plus one stub wheel (a dist-info holding a name and a version, no code) per package the node
has, at the version it has. A missing wheel, a dependency nobody fetched, or a bound the node's version does not meet
fails it, naming what. On the node: `pip install --no-index --find-links DIR mmpg`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TORCH = ("torch", "torchvision")
SDIST_ONLY = {"deepspeed": {"DS_BUILD_OPS": "0"}}  # built here; environment for its build


def norm(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def platforms(platform: str) -> list[str]:
    """Every tag a node of `platform` accepts, newest first: pip matches each tag exactly, so manylinux_2_28 must
    also list 2_27 ... 2_5 and the legacy aliases (manylinux2014 = 2_17, 2010 = 2_12, 1 = 2_5)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    tags += [f"manylinux{alias}_{arch}" for alias, n in (("2014", 17), ("2010", 12), ("1", 5)) if glibc >= n]
    return tags


def pip_flags(python: str, platform: str) -> list[str]:
    """pip flags that select wheels for CPython `python` (e.g. 3.12) on `platform`."""
    if not re.fullmatch(r"3\.\d+", python):
        raise ValueError(f"--python {python!r}: give the node's Python as MAJOR.MINOR, e.g. 3.12")
    abi = "cp" + python.replace(".", "")
    flags = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", abi,
             "--abi", "abi3", "--abi", "none"]
    for tag in platforms(platform):
        flags += ["--platform", tag]
    return flags


def read_have(path: str | None) -> dict[str, str]:
    """{normalized name: version} from a `pip freeze` of the node (other lines, e.g. `-e` or `@ file`, skipped)."""
    have = {}
    for line in Path(path).read_text().splitlines() if path else []:
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith(("#", "-")):
            have[norm(name)] = version.strip()
    return have


def requirements(have: dict[str, str], with_torch: bool = False) -> list[str]:
    """mmpg's requirements (installed metadata, no extras) the node lacks."""
    from importlib import metadata

    from packaging.requirements import Requirement

    out = []
    for text in metadata.requires("mmpg") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if norm(req.name) in have or (norm(req.name) in TORCH and not with_torch):
            continue
        out.append(str(req))
    return out


def _pip(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=1800,
                          env=env)


def build(out: Path, python: str, platform: str, have: dict[str, str], with_torch: bool = False) -> list[str]:
    """Download (and build where only an sdist exists) into `out`; returns problems ([] when all arrived)."""
    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[2]
    problems = []
    proc = _pip(["wheel", "-q", "--no-deps", "-w", str(out), str(root)])
    if proc.returncode:
        problems.append(f"could not build mmpg's own wheel: {proc.stderr.strip()[-300:]}")
    reqs = requirements(have, with_torch)
    for req in reqs:  # sdist-only first: the download below then finds their wheels here and fetches their deps
        name = norm(re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0])
        if name not in SDIST_ONLY or list(out.glob(f"{name.replace('-', '_')}-*.whl")):
            continue
        proc = _pip(["wheel", "-q", "--no-deps", "-w", str(out), req], env={**os.environ, **SDIST_ONLY[name]})
        if proc.returncode:
            problems.append(f"{req}: could not build its wheel: {proc.stderr.strip()[-300:]}")
        elif any(not p.name.endswith("-py3-none-any.whl") for p in out.glob(f"{name.replace('-', '_')}-*.whl")):
            problems.append(f"{name}: the wheel built here is not pure Python; build it on the node instead")
    # One resolution for all, so the versions agree with each other and with what the node has: each node package
    # is offered as a stub wheel of its version with a local label ("2.11.0+node"), which pip ranks above the real
    # one, so it is taken instead of downloaded (torch and its CUDA libraries: gigabytes), then removed again.
    node = node_packages(have, with_torch)
    with tempfile.TemporaryDirectory(prefix="mmpg-node-") as tmp:
        stubs = [stub_wheel(Path(tmp), n, v if "+" in v else f"{v}+node").name for n, v in node.items()]
        Path(tmp, "node.txt").write_text("".join(f"{n}=={v.split('+')[0]}\n" for n, v in node.items()))
        proc = _pip(["download", "-q", "-d", str(out), "--find-links", str(out), "--find-links", tmp,
                     "-c", str(Path(tmp, "node.txt")), *pip_flags(python, platform), *reqs])
    for name in stubs:
        Path(out, name).unlink(missing_ok=True)
    if proc.returncode:
        problems.append("pip download: " + "\n".join(proc.stderr.strip().splitlines()[-4:])[:600])
    return problems


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel holding only a dist-info: pip reads its name and version, nothing is installed from it."""
    base = f"{name.replace('-', '_')}-{version}"
    files = {f"{base}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{base}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: mmpg-stub\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{base}.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{base}.dist-info/RECORD,,\n"
    path = folder / f"{base}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in files.items():
            z.writestr(member, text)
    return path


def check(out: Path, python: str, platform: str, have: dict[str, str], wanted: list[str]) -> tuple[list[str], str]:
    """pip's offline resolution of `wanted` for the node: ([name==version from the wheelhouse or "(node)"], pip's
    error or "")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}  # this machine's pip config left out
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    with tempfile.TemporaryDirectory(prefix="mmpg-wheelhouse-") as tmp:
        stubs = Path(tmp, "stubs")
        stubs.mkdir()
        for name, version in have.items():
            stub_wheel(stubs, name, version)
        report = Path(tmp, "report.json")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                               "--no-index", "--quiet", "--find-links", str(out), "--find-links", str(stubs),
                               "--target", str(Path(tmp, "target")), "--report", str(report),
                               *pip_flags(python, platform), *wanted], capture_output=True, text=True, env=env,
                              timeout=600)
        if proc.returncode:
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            return [], "\n".join(lines[-8:])
        import json

        items = json.loads(report.read_text())["install"]
    stub_uri = stubs.as_uri()
    return [f"{i['metadata']['name']}=={i['metadata']['version']}"
            + ("  (the node has it)" if i["download_info"]["url"].startswith(stub_uri) else "") for i in items], ""


def node_packages(have: dict[str, str], with_torch: bool) -> dict[str, str]:
    """What the node counts as having in the check: `--have`, and, without --with-torch, torch and torchvision at
    this machine's versions when `--have` does not name them (the node installs its CUDA build from its own index)."""
    from importlib import metadata

    out = dict(have)
    for name in () if with_torch else TORCH:
        if name not in out:
            try:
                out[name] = metadata.version(name).split("+")[0]
            except metadata.PackageNotFoundError:
                pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmpg.doctor.wheelhouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("cmd", choices=("build", "check"))
    parser.add_argument("--python", required=True, help="the node's Python, MAJOR.MINOR (e.g. 3.12)")
    parser.add_argument("--platform", required=True, help="the node's wheel platform, e.g. manylinux_2_28_x86_64 "
                        "(glibc 2.28; `ldd --version` on the node) or manylinux_2_28_aarch64")
    parser.add_argument("--out", required=True, help="the wheelhouse folder")
    parser.add_argument("--have", default=None, help="`pip freeze` of the node: what it has is not fetched")
    parser.add_argument("--with-torch", action="store_true", help="also fetch torch and torchvision (from this "
                        "machine's index: usually the CPU or the default CUDA build)")
    args = parser.parse_args(argv)
    try:
        pip_flags(args.python, args.platform)
    except ValueError as err:
        parser.error(str(err))
    have = read_have(args.have)
    out = Path(args.out)
    if args.cmd == "build":
        problems = build(out, args.python, args.platform, have, args.with_torch)
        for p in problems:
            print(f"PROBLEM: {p}")
        if problems:
            return 1
    resolved, error = check(out, args.python, args.platform, node_packages(have, args.with_torch), ["mmpg"])
    if error:
        print(f"the node cannot install mmpg offline from {out} (Python {args.python}, {args.platform}):\n{error}")
        return 1
    size = sum(p.stat().st_size for p in out.glob("*.whl"))
    print(f"{out}: pip installs mmpg offline for CPython {args.python} {args.platform} from it "
          f"({len(list(out.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB):")
    print("\n".join(f"  {line}" for line in sorted(resolved)))
    print(f"on the node: pip install --no-index --find-links {out} mmpg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
