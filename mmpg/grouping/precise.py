"""Float32 compute on a 16-bit model's own weights, for the self-check (`mmpg.grouping.selfcheck`).

Why: in bf16 the grouped and the repeated forward round along different paths (other matmul shapes and reduction
orders), and the difference grows with depth to as much as the faults the self-check exists to catch (~0.004 nat at
28 layers on tiny models against 0.04); in float32 the two agree to ~1e-6 (docs/grouping.md, "Guards"). A float32
copy of a 7B model would cost 28 GB; instead, inside `float32_compute(model)`

    every module with parameters of its own, on entry: its 16-bit parameters' storage is swapped for a float32 copy,
        its 16-bit floating inputs are cast to float32;
    on exit (before any other exit hook, so ZeRO-3's release sees the original tensors): the original storage back,

so at most one module's float32 copy exists at a time (at most vocab x hidden x 4 bytes: 2.2 GB for Qwen2.5-VL-7B),
the checked group's activations are float32, and the weights are bit-for-bit the run's own (bf16 -> fp32 is exact,
and the original tensors are put back, so views into an optimizer's flat buffer stay views). TF32 matmuls are off
inside (`highest` precision). `kernel_dtype`: the grouped attention's kernel still runs in the run's dtype
(`GroupingState.kernel_dtype`): flash has no float32 kernel, and the kernel is part of what is checked; only q/k/v and
the attention output of the grouped forward are then rounded to 16 bits, the repeated forward attends in float32.
"""

from __future__ import annotations

import contextlib

import torch

from mmpg.grouping.patch import grouping_state

HALF = (torch.bfloat16, torch.float16)


def _up(x):
    if torch.is_tensor(x):
        return x.float() if x.dtype in HALF else x
    if isinstance(x, (tuple, list)):
        return type(x)(_up(v) for v in x)
    if isinstance(x, dict):
        return {k: _up(v) for k, v in x.items()}
    return x


def _hooks(module, params, stashes):
    stash = []
    stashes.append((params, stash))

    def enter(mod, args, kwargs):
        stash.append([p.data for p in params])
        for p in params:
            p.data = p.data.float()
        return _up(args), _up(kwargs)

    def leave(mod, args, output):
        for p, data in zip(params, stash.pop()):
            p.data = data
        return output

    return (module.register_forward_pre_hook(enter, with_kwargs=True),
            module.register_forward_hook(leave, prepend=True))


@contextlib.contextmanager
def float32_compute(model, kernel_dtype: torch.dtype | None = None):
    """Inside: `model` computes in float32 on its own 16-bit weights (module docstring); the grouped attention's
    kernel in `kernel_dtype` (None: float32 too)."""
    handles, stashes = [], []
    precision = torch.get_float32_matmul_precision()
    try:
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if p.dtype in HALF]
            if params:
                handles.extend(_hooks(module, params, stashes))
        grouping_state(model).kernel_dtype = kernel_dtype
        torch.set_float32_matmul_precision("highest")
        yield model
    finally:
        torch.set_float32_matmul_precision(precision)
        grouping_state(model).kernel_dtype = None
        for handle in handles:
            handle.remove()
        for params, stash in stashes:  # a forward that raised inside a module: its own tensors back
            while stash:
                for p, data in zip(params, stash.pop()):
                    p.data = data
