"""What travels to the lent GPU machine beside the working tree (`wheels/`), and the proof, made here, that it is
complete for that machine's image.

The GPU image (as recorded 2026-11-17): Python 3.12, torch 2.11.0+cu130, transformers 5.17.0 and the
packages in IMAGE; no package registry. What mmpg's GPU checks (scripts/gpu_check.sh: the `gpu` tests, `mmpg train`
in one process, `mmpg bench`) import beyond it is BUNDLE: `scripts/gpu_bundle.sh` downloads those wheels (cp312,
manylinux x86-64; deepspeed, an sdist only, is built here into a pure-Python wheel), and renders the synthetic
training videos into wheels/synth/ (rendering needs `av`, which does not travel: EXCLUDED).

Completeness (`check_bundle`), without the image: pip resolves the install of BUNDLE's top-level packages offline
for cp312 manylinux against wheels/ plus one stub wheel per image package (a dist-info with a name and a version,
no code), so the image's packages count as present at the version on record — or, where none is on record, at the
lowest version that a recorded package's own requirements allow (IMAGE_FLOORS, named), or at version 0 (any
requirement with a lower bound then fails, as it should until someone records the version). A missing wheel, a
dependency the image lacks, or a bound the image may not meet fails the resolution; a wheel in wheels/ that the
resolution does not use fails the check too (the bundle is exactly what is needed).
On the device `deps_problems` checks the same requirements against the versions really installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LIMIT_BYTES = 64 * 2**20  # the device tool's limit on what travels: working tree + carried paths


@dataclasses.dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    why: str
    top: bool = False  # a package mmpg imports itself (the others are dependencies of these)
    sdist: bool = False  # only an sdist on the registry: built here with `pip wheel`


BUNDLE = [
    Wheel("omegaconf", "2.4.0", "mmpg.config: every mmpg train run", top=True),
    Wheel("deepspeed", "0.19.8", "mmpg.train.engine: mmpg train, ZeRO-0 and ZeRO-3 (ops JIT-built on use)",
          top=True, sdist=True),
    Wheel("hjson", "3.1.0", "deepspeed"),
    # deepspeed wants pydantic >= 2.0; 2.9.2 is the newest whose typing-extensions bound (>= 4.6.1 on Python 3.12)
    # the image is known to meet (torch 2.11 requires >= 4.10.0); 2.10 on want >= 4.12.2, a version not on record
    Wheel("pydantic", "2.9.2", "deepspeed (config models)"),
    Wheel("pydantic-core", "2.23.4", "pydantic 2.9.2 (compiled, cp312)"),
    Wheel("annotated-types", "0.7.0", "pydantic"),
    Wheel("qwen-vl-utils", "0.0.14", "mmpg.data.video: frame sampling of the training videos", top=True),
    Wheel("decord", "0.6.0", "the video reader mmpg forces in qwen-vl-utils (FORCE_QWENVL_VIDEO_READER)", top=True),
]
EXCLUDED = {  # requirements of bundled wheels that deliberately do not travel
    "av": "qwen-vl-utils requires it for its torchvision/av reader only; mmpg forces decord, and the synthetic videos "
          "are rendered here (wheels/synth/), so nothing on the device imports av (the rehearsal's import audit "
          "checks)",
}
OPTIONAL = {  # wheels gpu_check.sh uses when someone puts one in wheels/; none is downloaded
    "flash-attn": "only a wheel built for the image's torch 2.11.0+cu130 and Python 3.12 helps (PyPI has an sdist; "
                  "building it on the device takes longer than a lease)",
}

# The GPU image's packages; versions where a pip list on record gives them (2026-11), else None.
IMAGE = dict.fromkeys("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
IMAGE.update({"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
              "tokenizers": "0.23.2", "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0",
              "transformers": "5.17.0", "triton": "3.6.0", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
              "torchmetrics": "1.9.0", "pytorch-lightning": "2.6.6", "jax": "0.11.2", "jaxlib": "0.11.2",
              "onnx": "1.23.1", "onnxruntime": "1.30.0", "cupy-cuda13x": "14.2.0", "botorch": "0.18.1",
              "gpytorch": "1.15.2", "sentence-transformers": "6.0.1"})
IMAGE_FLOORS = {  # no version on record: the lowest a recorded package's requirements allow (read from its metadata)
    "typing-extensions": ("4.10.0", "torch 2.11.0 requires typing-extensions>=4.10.0"),
    "packaging": ("20.0", "transformers 5.17.0 requires packaging>=20.0"),
    "pyyaml": ("5.1", "transformers 5.17.0 requires pyyaml>=5.1"),
    "tqdm": ("4.60", "transformers 5.17.0 requires tqdm>=4.60"),
}
PYTHON = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + ["manylinux2014_x86_64",
                                                                      "manylinux2010_x86_64", "manylinux1_x86_64"]


def norm(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_version(name: str) -> tuple[str, str]:
    """(version the image counts as having, where that comes from)."""
    name = norm(name)
    if IMAGE.get(name):
        return IMAGE[name], "on record"
    if name in IMAGE_FLOORS:
        return IMAGE_FLOORS[name][0], "floor: " + IMAGE_FLOORS[name][1]
    return "0", "no version on record"


def wheel_files(folder: Path) -> dict[str, Path]:
    """normalized name -> wheel file in `folder` (not its subfolders); two versions of one name: ValueError."""
    out: dict[str, Path] = {}
    for path in sorted(Path(folder).glob("*.whl")):
        name = norm(path.name.split("-")[0])
        if name in out:
            raise ValueError(f"{folder}: two wheels of {name} ({out[name].name}, {path.name}); keep one (pip would "
                             "stop the whole install)")
        out[name] = path
    return out


def pip_specs() -> list[str]:
    """`name==version` of every wheel to fetch, `sdist:` before those built here (read by scripts/gpu_bundle.sh)."""
    return [("sdist:" if w.sdist else "") + f"{w.name}=={w.version}" for w in BUNDLE]


def download_flags() -> list[str]:
    """pip flags that select wheels for the image: CPython 3.12, manylinux x86-64 (pip matches each tag exactly)."""
    flags = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
             "--abi", "cp" + PYTHON.replace(".", ""), "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def _stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel holding only a dist-info: pip reads its name and version, nothing is installed from it."""
    base = f"{name.replace('-', '_')}-{version}"
    files = {f"{base}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{base}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: mmpg-stub\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{base}.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{base}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{base}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def _clean_pip_env() -> dict[str, str]:
    """This machine's pip configuration (find-links, extra indexes, constraints) left out: only wheels/ and stubs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def resolve(wheels: Path, python: str = sys.executable) -> tuple[list[dict], str]:
    """pip's offline resolution of BUNDLE's top-level packages (and an optional flash-attn wheel) for the image.
    Returns ([{"name", "version", "source": "bundle" | "image" | "excluded"}], pip's error text or "")."""
    wheels = Path(wheels).resolve()
    present = wheel_files(wheels)
    with tempfile.TemporaryDirectory(prefix="mmpg-bundle-") as tmp:
        stubs = Path(tmp, "stubs")
        stubs.mkdir()
        for name in set(IMAGE) | set(IMAGE_FLOORS):
            if name not in present:  # a wheel of an image package in wheels/ is reported by check_bundle
                _stub_wheel(stubs, name, image_version(name)[0])
        for name in EXCLUDED:
            _stub_wheel(stubs, name, "0")
        wanted = [f"{w.name}=={w.version}" for w in BUNDLE if w.top]
        wanted += [name for name in OPTIONAL if name in present]
        report = Path(tmp, "report.json")
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index", "--quiet",
               "--find-links", str(wheels), "--find-links", str(stubs), "--target", str(Path(tmp, "target")),
               "--report", str(report), *download_flags(), *wanted]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_pip_env(), timeout=300)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            return [], "\n".join(lines[-8:])
        items = json.loads(report.read_text())["install"]
    out = []
    for item in items:
        name, url = norm(item["metadata"]["name"]), item["download_info"]["url"]
        source = "bundle" if url.startswith(wheels.as_uri()) else ("excluded" if name in EXCLUDED else "image")
        out.append({"name": name, "version": item["metadata"]["version"], "source": source})
    return out, ""


def check_bundle(wheels: Path, python: str = sys.executable) -> tuple[list[str], list[str]]:
    """(lines to print, problems). Problems: a BUNDLE wheel missing or of another version, a wheel no resolution
    uses, a wheel of a package the image has, or pip's offline resolution failing."""
    lines, problems = [], []
    try:
        present = wheel_files(wheels)
    except ValueError as err:
        return lines, [str(err)]
    for w in BUNDLE:
        path = present.get(norm(w.name))
        if path is None:
            problems.append(f"{wheels}/: no wheel of {w.name}=={w.version} (needed by {w.why}); "
                            "run scripts/gpu_bundle.sh")
        elif path.name.split("-")[1] != w.version:
            problems.append(f"{path}: {w.name} {path.name.split('-')[1]}, but the bundle pins {w.version}")
    for name, path in present.items():
        if name in IMAGE or name in IMAGE_FLOORS:
            problems.append(f"{path.name}: the image already has {name} ({image_version(name)[1]}); remove it")
    resolved, error = resolve(wheels, python)
    if error:
        return lines, problems + [f"pip cannot install the bundle offline for Python {PYTHON} manylinux x86-64 with "
                                  f"the image's packages present:\n{error}"]
    used = {r["name"] for r in resolved if r["source"] == "bundle"}
    for name, path in present.items():
        if name not in used and name not in IMAGE:
            problems.append(f"{path.name}: not needed by the GPU checks (no resolution uses it); remove it")
    lines.append(f"pip resolves the install offline for CPython {PYTHON} manylinux x86-64 ({len(resolved)} "
                 "distributions):")
    for r in sorted(resolved, key=lambda r: (r["source"], r["name"])):
        where = {"bundle": "wheels/" + present[r["name"]].name if r["name"] in present else "wheels/",
                 "image": "the image, " + image_version(r["name"])[1],
                 "excluded": "not carried: " + EXCLUDED.get(r["name"], "")[:60] + "..."}[r["source"]]
        lines.append(f"  {r['name'] + '==' + r['version']:28} {where}")
    return lines, problems


def _git_files(root: Path, *args: str) -> list[Path]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *args], capture_output=True, check=True).stdout
    return [root / p for p in out.decode().split("\0") if p]


def tree_bytes(root: Path) -> int:
    """What the device tool sends without `carry`: tracked files as they are on disk, untracked files git does not
    ignore, and shared/ when the checkout has one."""
    root = Path(root)
    files = set(_git_files(root)) | set(_git_files(root, "--others", "--exclude-standard"))
    if (root / "shared").is_dir():
        files |= {p for p in (root / "shared").rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


def size_lines(root: Path, carried: list[Path]) -> tuple[list[str], bool]:
    """(lines, fits): the working tree plus the carried folders against the 64 MiB the device tool takes."""
    tree = tree_bytes(root)
    parts = [("working tree (git ls-files + untracked, not ignored)", tree)]
    parts += [(f"{os.path.relpath(c, root)}/ (carried)", folder_bytes(c)) for c in carried if Path(c).exists()]
    total = sum(n for _, n in parts)
    lines = [f"  {what:56} {n / 2**20:8.2f} MiB" for what, n in parts]
    fits = total <= LIMIT_BYTES
    lines.append(f"  {'total':56} {total / 2**20:8.2f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB"
                 + ("" if fits else "  -> TOO LARGE: the device tool would refuse the call"))
    return lines, fits


def deps_problems(target: Path) -> list[str]:
    """On the device, after `pip install --no-deps --target`: every requirement of each installed wheel (extras
    left out, markers evaluated here) met by what is importable now (the target on PYTHONPATH plus the image)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    problems = []
    for dist in metadata.distributions(path=[str(target)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if norm(req.name) in EXCLUDED:
                continue
            try:
                found = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} {dist.version} requires {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(found, prereleases=True):
                problems.append(f"{dist.metadata['Name']} {dist.version} requires {req}: found {found}")
    return problems


def image_readings() -> list[str]:
    """On the device: the versions on record or assumed (floors) against what is installed."""
    from importlib import metadata

    lines = []
    for name in sorted(n for n in IMAGE if IMAGE[n]) + sorted(IMAGE_FLOORS):
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            found = "NOT INSTALLED"
        version, source = image_version(name)
        lines.append(f"  {name:24} {source.split(':')[0]:12} {version:10} found {found}")
    return lines


def audit_problems(log: Path, root: Path) -> tuple[list[str], list[str]]:
    """(lines, problems) from the rehearsal's import audit (scripts/gpu_check_audit/sitecustomize.py): every
    third-party package that mmpg's or the tests' own code imported must be the image's or the bundle's."""
    from importlib import metadata

    root = Path(root)
    seen: dict[str, str] = {}
    for line in Path(log).read_text().splitlines() if Path(log).exists() else []:
        top, _, importer = line.partition("\t")
        seen.setdefault(top, importer)
    local = {p.stem for d in ("tests", "scripts") for p in (root / d).glob("*.py")} | {"mmpg", "app", "tests"}
    dists = metadata.packages_distributions()
    bundle = {norm(w.name) for w in BUNDLE}
    found, problems = {}, []
    for top, importer in sorted(seen.items()):
        if top in sys.stdlib_module_names or top in local or top.startswith("_") and top[1:] in sys.stdlib_module_names:
            continue
        names = [norm(d) for d in dists.get(top, [])]
        if not names:
            problems.append(f"{importer} imports {top}, which no installed distribution provides")
            continue
        for name in names:
            ok = name in IMAGE or name in IMAGE_FLOORS or name in bundle
            found[name] = "image" if name in IMAGE or name in IMAGE_FLOORS else ("bundle" if ok else "MISSING")
            if not ok:
                problems.append(f"{importer} imports {top} (distribution {name}): neither the image nor the bundle "
                                "has it")
    lines = [f"import audit: {len(seen)} top-level imports by mmpg and the tests; third-party: "
             + ", ".join(f"{n} ({s})" for n, s in sorted(found.items()))]
    return lines, problems


def bundle_lines(wheels: Path) -> tuple[list[str], list[str]]:
    """(the wheel list with sizes and what needs each, problems: a missing or extra wheel)."""
    wheels = Path(wheels)
    try:
        present = wheel_files(wheels)
    except ValueError as err:
        return [], [str(err)]
    why = {norm(w.name): w for w in BUNDLE}
    lines, problems, total = [], [], 0
    for name, path in sorted(present.items()):
        size = path.stat().st_size
        total += size
        w = why.get(name)
        need = w.why if w else OPTIONAL.get(name, "NOT IN THE BUNDLE: remove it")
        lines.append(f"  {path.name:80} {size / 2**20:7.2f} MiB  {need}")
        if not w and name not in OPTIONAL:
            problems.append(f"{path}: not in the bundle")
    problems += [f"no wheel of {w.name}=={w.version} in {wheels}/" for w in BUNDLE if norm(w.name) not in present]
    lines.append(f"  {len(present)} wheels, {total / 2**20:.2f} MiB")
    return lines, problems
