"""model.gradient_checkpointing acts on the policy as mmpg trains it: in eval mode (no dropout), where transformers'
layers skip checkpointing unless flagged (`mmpg.models.loading.checkpoint_in_eval_mode`). Checked by what
checkpointing does — each decoder layer runs again in backward — and by the gradients, which stay those of the
policy without it (float32, the grouped forward)."""

from __future__ import annotations

import pytest
import torch

from batches import completions, vl_batch
from mmpg.grouping import grouped_logprobs
from mmpg.models.loading import load_policy

VIDEOS, GROUP_SIZES, LENGTHS = [(4, 56, 56)], [3], [5, 3, 4]


def _layer_runs(model, run) -> dict[str, int]:
    """How many times each decoder layer's MLP ran during `run()` (its forward wrapped: module hooks do not fire
    in the backward's recompute)."""
    counts: dict[str, int] = {}
    mlps = [(name, m) for name, m in model.named_modules() if name.endswith(".mlp") and ".layers." in name]
    for name, m in mlps:
        def counted(*args, _f=m.forward, _n=name, **kwargs):
            counts[_n] = counts.get(_n, 0) + 1
            return _f(*args, **kwargs)
        m.forward = counted
    try:
        run()
    finally:
        for _, m in mlps:
            del m.forward
    return counts


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_checkpointing_recomputes_each_layer_in_eval_mode(family, tiny_dirs, load_tiny):
    _, processor = load_tiny(family)
    plain = load_policy(tiny_dirs[family], dtype="float32")
    ckpt = load_policy(tiny_dirs[family], dtype="float32", gradient_checkpointing=True)
    inputs = vl_batch(processor, family, VIDEOS, "left")
    ids, mask = completions(GROUP_SIZES, LENGTHS, plain.config.get_text_config().vocab_size)
    grads = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        assert not model.training  # trained in eval mode, as the trainer does
        assert not any(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))

        def step(model=model):
            (grouped_logprobs(model, inputs, ids, mask, GROUP_SIZES) * mask).sum().backward()

        counts = _layer_runs(model, step)
        assert counts, "no decoder layer found"
        # forward once; with checkpointing each layer runs again in backward
        assert set(counts.values()) == ({2} if name == "ckpt" else {1}), (name, counts)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["plain"].keys() == grads["ckpt"].keys()
    worst = max((grads["plain"][n] - grads["ckpt"][n]).abs().max().item() for n in grads["plain"])
    assert worst <= 1e-5, f"checkpointing changed a gradient by {worst:.2e}"
