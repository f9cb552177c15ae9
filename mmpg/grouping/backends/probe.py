"""What the `flash` backend really needs, probed instead of assumed (`import flash_attn` succeeding proves little).

* FlashAttention 2 >= 2.7: `flash_attn.flash_attn_interface._flash_attn_varlen_forward` takes `window_size_left` /
  `window_size_right` and returns `(out, lse, S_dmask, rng_state)` from 2.7.0 on; in 2.6 its second value is the
  padded q, not the LSE, so an older version would merge garbage. Refused, with the version named.
* Not FlashAttention 4 alone: the `flash-attn-4` wheel installs only `flash_attn/cute/` without an `__init__.py`, so
  `import flash_attn` succeeds as a namespace package (no `__version__`, no `flash_attn_interface`). Refused.
* A GPU FlashAttention 2 runs on: compute capability >= 8.0 (Ampere, Ada, Hopper, Blackwell), and a build that has
  code for it — checked by one tiny varlen forward (a wheel built for other architectures fails there with "no
  kernel image is available"), once per device.
`flash_status(device)` answers (usable, reason); "auto" takes flash only when usable, an explicit `flash` raises the
reason. Results are cached per device; `reset()` clears them (tests swap the installed package).
"""

from __future__ import annotations

import functools

import torch
from packaging.version import Version

FLASH_MIN_VERSION = Version("2.7")
FLASH_MIN_CAPABILITY = (8, 0)
INSTALL_HINT = "install FlashAttention 2: pip install --no-build-isolation 'flash-attn>=2.7' (after torch)"


def flash_interface():
    """(forward, backward) varlen functions of an installed flash-attn >= 2.7, < 3; ImportError naming what is wrong
    otherwise."""
    try:
        import flash_attn
    except ImportError as err:
        raise ImportError(f"flash-attn is not importable ({err}); {INSTALL_HINT}") from err
    version = getattr(flash_attn, "__version__", None)
    if version is None:
        raise ImportError("`flash_attn` is a namespace package without a version — FlashAttention 4 (`flash-attn-4`, "
                          f"only `flash_attn.cute`) has no varlen backward API the flash backend uses; {INSTALL_HINT}")
    if not FLASH_MIN_VERSION <= Version(Version(version).base_version) < Version("3"):
        raise ImportError(f"the flash backend needs flash-attn >= {FLASH_MIN_VERSION}, < 3 (its varlen forward returns "
                          f"the LSE and takes window_size_left/right from 2.7.0 on); found {version}; {INSTALL_HINT}")
    try:
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward
    except ImportError as err:
        raise ImportError(f"flash-attn {version} has no usable flash_attn_interface ({err}); {INSTALL_HINT}") from err
    return _flash_attn_varlen_forward, _flash_attn_varlen_backward


def gpu_facts(device: torch.device) -> tuple[str, tuple[int, int]]:
    """(name, compute capability) of a CUDA device."""
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)


def _smoke_test(device: torch.device) -> None:
    """One tiny varlen forward: raises if the installed build has no kernel for this GPU."""
    forward, _ = flash_interface()
    q = torch.zeros(2, 1, 64, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2], device=device, dtype=torch.int32)
    forward(q, q, q, cu, cu, 2, 2, 0.0, 0.125, True)
    torch.cuda.synchronize(device)


@functools.cache
def flash_status(device: torch.device) -> tuple[bool, str]:
    """(usable, reason). Never raises."""
    if device.type != "cuda":
        return False, f"flash-attn needs a CUDA device, not {device}"
    try:
        flash_interface()
    except ImportError as err:
        return False, str(err)
    name, (major, minor) = gpu_facts(device)
    if (major, minor) < FLASH_MIN_CAPABILITY:
        return False, f"FlashAttention 2 needs compute capability >= 8.0; {name} has {major}.{minor}"
    try:
        _smoke_test(device)
    except RuntimeError as err:
        return False, (f"flash-attn does not run on {name} ({major}.{minor}): "
                       f"{str(err).splitlines()[0]} — rebuild it with FLASH_ATTN_CUDA_ARCHS including {major}{minor}")
    return True, ""


_ON_RESET: list = []  # caches built on the probe's answers (`varlen.flash_kernel`), cleared with them


def reset() -> None:
    """Forget the probe's answers and the flash kernels built on them (a test swapped the installed package)."""
    flash_status.cache_clear()
    for clear in _ON_RESET:
        clear()
