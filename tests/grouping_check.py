"""The comparison every grouped-forward test makes: logprobs and every parameter's gradient, grouped vs repeated.

A failing comparison names the worst entry or parameter and its difference."""

from __future__ import annotations

import torch

from mmpg.grouping import grouped_logprobs, repeated_logprobs

LOGP_ATOL = 1e-5  # max abs difference of masked-in logprobs, float32
GRAD_RTOL = 1e-4  # ||g_grouped - g_repeated|| / ||g_repeated|| per parameter, float32


def _grads(model, fn, weights):
    model.zero_grad(set_to_none=True)
    logps = fn()
    # A weighted sum so every entry and every row gets a different gradient signal.
    (logps * weights).sum().backward()
    return logps.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, inputs, ids, mask, group_sizes, backend=None, check_grads=True, atol=LOGP_ATOL, rtol=GRAD_RTOL,
            **both):
    """Returns (max logprob diff, worst relative gradient diff) and asserts both bounds. `both`: keywords for both
    forwards (`completion_visuals`)."""
    weights = torch.linspace(0.5, 1.5, ids.numel(), device=ids.device).view_as(ids)
    run_g = lambda: grouped_logprobs(model, inputs, ids, mask, group_sizes, backend=backend, **both)  # noqa: E731
    run_r = lambda: repeated_logprobs(model, inputs, ids, mask, group_sizes, **both)  # noqa: E731
    if not check_grads:
        with torch.no_grad():
            g, r = run_g(), run_r()
        g_grads = r_grads = {}
    else:
        g, g_grads = _grads(model, run_g, weights)
        r, r_grads = _grads(model, run_r, weights)
    assert g.shape == ids.shape and g.dtype == torch.float32
    assert torch.all(g[mask == 0] == 0), "entries outside the mask must be exactly 0"
    diff = (g - r).abs() * mask
    worst = int(diff.argmax())
    max_diff = float(diff.max())
    assert max_diff <= atol, f"logprob diff {max_diff:.3g} at row {worst // ids.shape[1]}, token {worst % ids.shape[1]}"
    rel = {}
    assert set(g_grads) == set(r_grads), f"parameters with grads differ: {set(g_grads) ^ set(r_grads)}"
    for name, ref in r_grads.items():
        rel[name] = float((g_grads[name] - ref).norm() / ref.norm().clamp_min(1e-30))
    worst_name = max(rel, key=rel.get) if rel else None
    worst_rel = rel[worst_name] if rel else 0.0
    assert worst_rel <= rtol, f"gradient of {worst_name} differs by {worst_rel:.3g} (relative)"
    return max_diff, worst_rel, g_grads
