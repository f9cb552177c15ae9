"""What `mmpg doctor` reads of the machine before it runs anything: Python, torch and the CUDA it was built for, the
NVIDIA driver, the GPUs, and the packages mmpg's paths need (transformers, flash-attn, DeepSpeed, peft, vLLM), each
installed and usable or not, and why not.

`cuda_status()` answers (usable, reason) for the CUDA device; the GPU checks run only when it is usable, otherwise
their rows say NOT RUN with this reason. The packages are rows too: a missing optional package is NOT RUN (its
paths are not checked), a broken required one FAILS.
"""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from mmpg.doctor.results import Row


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def cuda_status() -> tuple[bool, str]:
    """(a usable CUDA device, the line that says which or why not)."""
    import torch

    if torch.version.cuda is None:
        return False, (f"torch {torch.__version__} is a CPU build: install one built for CUDA "
                       "(scripts/env.sh, MMPG_TORCH=...)")
    driver = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else 0
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    if not driver:
        return False, "no NVIDIA driver found (is this a GPU machine? `nvidia-smi` should list the GPU)"
    if driver < major * 1000 + minor * 10:
        return False, (f"the NVIDIA driver supports CUDA up to {_cuda_version(driver)}, but this torch needs CUDA >= "
                       f"{torch.version.cuda}: update the driver, or install a torch built for CUDA "
                       f"{_cuda_version(driver)} or older (MMPG_TORCH=... before scripts/env.sh)")
    if not torch.cuda.is_available():
        return False, ("torch sees no CUDA device although the driver is there (CUDA_VISIBLE_DEVICES? a container "
                       "started without --gpus?)")
    name = torch.cuda.get_device_name(0)
    cap = ".".join(map(str, torch.cuda.get_device_capability(0)))
    mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    return True, (f"{torch.cuda.device_count()} GPU(s); device 0: {name}, compute capability {cap}, {mem:.0f} GiB; "
                  f"driver supports CUDA {_cuda_version(driver)}")


def _version(module: str) -> tuple[str | None, str]:
    """(version or None, why not importable)."""
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is the answer
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return str(getattr(mod, "__version__", "?")), ""


def vllm_env(root: Path | None = None) -> tuple[str | None, str]:
    """(the vLLM environment's python, or None and why): .venv-vllm beside the checkout (scripts/env.sh vllm)."""
    root = root or Path(__file__).resolve().parents[2]
    py = root / ".venv-vllm" / "bin" / "python"
    if py.exists() and (root / ".venv-vllm" / ".mmpg-installed").exists():  # unstamped: half made, absent
        return str(py), ""
    try:
        importlib.import_module("vllm")
        return sys.executable, ""
    except Exception:  # noqa: BLE001
        return None, f"no vLLM environment ({py.parent.parent} is absent and vllm does not import here): " \
                     "scripts/env.sh vllm makes it"


def package_rows(cuda: bool) -> list[Row]:
    rows = []
    for module, need, required in (("transformers", "every path", True), ("deepspeed", "training", True),
                                   ("peft", "LoRA", True), ("flash_attn", "the flash backends (CUDA)", False)):
        version, why = _version(module)
        name = module.replace("_", "-")
        if version is not None:
            detail = ""
            if module == "flash_attn":
                import torch

                from mmpg.grouping.backends.probe import flash_status

                usable, detail = flash_status(torch.device("cuda", 0) if cuda else torch.device("cpu"))
                detail = "usable" if usable else "installed but NOT usable: " + detail
            rows.append(Row("environment", f"env/{name}", f"{name} ({need})", "PASS", version, detail))
        elif required:
            rows.append(Row("environment", f"env/{name}", f"{name} ({need})", "FAIL", "", why))
        else:
            rows.append(Row("environment", f"env/{name}", f"{name} ({need})", "NOT RUN", "",
                            f"not installed ({why}); pip install --no-build-isolation 'flash-attn>=2.7' after torch "
                            "(a compile of minutes to an hour where no wheel fits)"))
    py, why = vllm_env()
    rows.append(Row("environment", "env/vllm", "vLLM environment (rollout.engine=vllm)",
                    "PASS" if py else "NOT RUN", py or "", why))
    return rows


def environment() -> tuple[list[Row], list[str], dict, bool]:
    """(rows, lines for the report's head, record for doctor.json, CUDA usable)."""
    import torch

    cuda, line = cuda_status()
    record = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
              "cuda_build": torch.version.cuda, "cuda": line, "gpus": torch.cuda.device_count() if cuda else 0}
    lines = [f"python {record['python']} on {record['platform']}",
             f"torch {torch.__version__} (built for CUDA {torch.version.cuda})", f"CUDA: {line}"]
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            record["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            record["nvidia_smi"] = f"nvidia-smi failed: {err}"
        lines.append(f"nvidia-smi: {record['nvidia_smi']}")
    rows = [Row("environment", "env/cuda", "CUDA device", "PASS" if cuda else "NOT RUN",
                line if cuda else "", "" if cuda else line)]
    rows += package_rows(cuda)
    record["packages"] = {r.id.split("/", 1)[1]: r.figure or None for r in rows[1:]}
    return rows, lines, record, cuda
