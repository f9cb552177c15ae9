"""The bounds of the self-check (`mmpg.grouping.selfcheck`): how far a figure may differ from the repeated forward's
before the fast path is called wrong, per dtype, backend and depth. The measurements behind each bound are in
docs/grouping.md (section "Guards"); u is the unit roundoff (2^-8 bf16, 2^-11 fp16), L the decoder layers.

  * logprobs, everything in float32 (float32 runs; the `sdpa` / `lse_reference` kernels of a 16-bit run's float32
    check): 1e-4, where a correct forward stays under 1e-6 and a wrong one is off by >= 1e-2.
  * logprobs, a 16-bit `flash` / `flex` kernel inside the float32 check: 0.25 x u x L (0.027 at 28 layers in bf16),
    about 28x the measured kernel rounding and under a 0.04 nat fault.
  * an engine's 16-bit logprobs against the repeated forward in the same dtype (`bound_for`): 1.6 x u x L (bf16),
    2.0 x u x L (fp16), 4x the measured rounding; also the drift alarm's and the doctor's bound.
  * the leak probe: 1e-6 (a masked key adds an exact zero, so a correct forward gives 0).
  * the probe gradients' max relative difference (`gradient_bound`): 1e-4 in float32; 8 x u x sqrt(L) in a 16-bit
    run, whose autograd part runs in the run's dtype and so catches gross backward faults only.
"""

from __future__ import annotations

import torch

FLOAT32_BOUND = 1e-4
# (unit roundoff u, max |difference| per u and decoder layer) of an engine's 16-bit logprobs
PER_LAYER_ULPS = {torch.bfloat16: (2.0 ** -8, 1.6), torch.float16: (2.0 ** -11, 2.0)}
KERNEL_PER_LAYER_ULPS = 0.25  # a 16-bit kernel inside the float32 check, per u and decoder layer
FLOAT32_KERNELS = ("sdpa", "lse_reference")  # backends checked in float32 throughout
LEAK_BOUND = 1e-6
GRAD_FLOAT32_BOUND = 1e-4  # the probe gradients' max relative difference in float32
GRAD_SQRT_LAYER_ULPS = 8.0  # ... in a 16-bit run, per unit roundoff and square root of the depth


def _layers(model) -> int:
    return int(getattr(model.config.get_text_config(), "num_hidden_layers", 1) or 1)


def bound_for(model, dtype: torch.dtype) -> float:
    """The largest max |engine - repeated| logprob difference accepted when both run in `dtype`."""
    if dtype not in PER_LAYER_ULPS:
        return FLOAT32_BOUND
    unit, ratio = PER_LAYER_ULPS[dtype]
    return ratio * unit * _layers(model)


def gradient_bound(model, dtype: torch.dtype) -> float:
    """The largest max relative difference of the probe gradients accepted in `dtype`."""
    if dtype not in PER_LAYER_ULPS:
        return GRAD_FLOAT32_BOUND
    return GRAD_SQRT_LAYER_ULPS * PER_LAYER_ULPS[dtype][0] * _layers(model) ** 0.5


def precise_bound(model, backend: str, dtype: torch.dtype) -> tuple[float, torch.dtype | None]:
    """(bound, kernel dtype) of the float32 grouped-forward check of a `dtype` run on `backend`: the kernel dtype is
    None where the kernel runs in float32 too."""
    if dtype not in PER_LAYER_ULPS or backend in FLOAT32_KERNELS:
        return FLOAT32_BOUND, None
    return KERNEL_PER_LAYER_ULPS * PER_LAYER_ULPS[dtype][0] * _layers(model), dtype
