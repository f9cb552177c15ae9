"""Faults in the grouped attention that the self-check must catch, injected without any hook of mmpg's: importing
this module (as a training run's reward module, `reward.function=injected_faults:digit_share`) wraps the grouped
attention's backends as `MMPG_TEST_FAULT` says; `install(name)` does it in a test's own process.

    later_group   responses of the second and later groups of a packed row cannot see their prefix's last token
    sibling_leak  a response's first token sees the previous response's last token (same group)
    backward      forward exact; the attention output's gradient x 1.01
    grad_mode     the attention output x 1.001 while autograd records; exact under no_grad

The mask faults run a dense attention under the layout's own rule (`GroupLayout.dense_mask`) with one change, so
everything else about them is exact."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import mmpg.grouping.attention as attention
from reward_fns import digit_share  # noqa: F401  (the reward the run uses)

_real_get_backend = attention.get_backend


def _dense(q, k, v, mask, scale):
    """q [1, Hq, T, D], k/v [1, Hkv, T, D], mask [T, T] -> [1, T, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].to(q.device), scale=scale)
    return out.transpose(1, 2)


def _later_group_mask(layout):
    mask = layout.dense_mask().clone()
    for b in range(1, layout.num_groups):
        last_prefix = layout.prefix_span(b)[1] - 1
        start, end = layout.responses_span(b)
        mask[start:end, last_prefix] = False
    return mask


def _sibling_leak_mask(layout):
    mask = layout.dense_mask().clone()
    for b in range(layout.num_groups):
        start = layout.responses_span(b)[0]
        lens = layout.response_lens[b]
        for j in range(1, len(lens)):
            first = start + sum(lens[:j])
            mask[first, first - 1] = True  # the previous response's last token
    return mask


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


def faulty(name: str):
    """get_backend with fault `name` applied."""
    def get_backend(backend):
        real = _real_get_backend(backend)

        def run(q, k, v, layout, scale):
            if name == "later_group":
                return _dense(q, k, v, _later_group_mask(layout), scale)
            if name == "sibling_leak":
                return _dense(q, k, v, _sibling_leak_mask(layout), scale)
            out = real(q, k, v, layout, scale)
            if name == "backward":
                return _ScaleGrad.apply(out)
            if name == "grad_mode" and torch.is_grad_enabled():
                return out * 1.001
            return out
        return run
    return get_backend


def install(name: str) -> None:
    attention.get_backend = faulty(name)


def uninstall() -> None:
    attention.get_backend = _real_get_backend


if os.environ.get("MMPG_TEST_FAULT"):
    install(os.environ["MMPG_TEST_FAULT"])
