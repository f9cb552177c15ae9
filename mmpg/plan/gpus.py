"""GPU presets for `mmpg plan`: memory, dense bf16 peak and bandwidth of the cards a plan can be made for.

The model's shape is `mmpg.models.geometry`; this module holds only the devices.
"""

from __future__ import annotations

import dataclasses

from mmpg.errors import UserError


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # GiB the card has; the plan keeps `headroom` of it free
    bf16_tflops: float  # dense bf16 tensor-core peak (no sparsity)
    bandwidth_tbs: float  # HBM/GDDR bandwidth, TB/s


GPUS = {  # vendors' data sheets (SXM parts where there are two)
    "a100-40": GPU("A100 40GB", 40, 312, 1.555), "a100-80": GPU("A100 80GB", 80, 312, 2.039),
    "h100": GPU("H100 80GB", 80, 989, 3.35), "h200": GPU("H200 141GB", 141, 989, 4.8),
    "a40": GPU("A40 48GB", 48, 149.7, 0.696), "l40s": GPU("L40S 48GB", 48, 362, 0.864),
    "4090": GPU("RTX 4090 24GB", 24, 165.2, 1.008),
}


def gpu(name: str) -> GPU:
    key = name.lower().replace(" ", "").replace("_", "-").replace("gb", "")
    key = {"a100": "a100-80", "rtx4090": "4090", "a10040": "a100-40", "a10080": "a100-80"}.get(key, key)
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)} or give --gpu-memory GB")
    return GPUS[key]
