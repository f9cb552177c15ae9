"""The trainer's loss is `mmpg.rl.algos.aggregate_loss`: a NaN or inf at a position the loss mask drops (padding, a
truncated response) never reaches the loss or the gradients, through `GRPOStep.update` itself."""

from __future__ import annotations

import math

import torch

from mmpg.bench import presets
from mmpg.bench.step import setup


def _tiny_step_case() -> dict:
    case = next(c for c in presets.preset_configs("tiny", "qwen2_5_vl") if c["level"] == "step")
    return dict(case, variant="mmpg", self_check="off")


def test_inf_reference_logprob_at_a_dropped_position_leaves_loss_and_weights_finite(step_process, monkeypatch):
    _, runner, _ = setup(_tiny_step_case(), torch.device("cpu"))
    grpo = runner.grpo
    assert grpo.cfg.algorithm.beta > 0  # the k3 term reads the reference's logprobs
    own_mask = grpo._loss_mask
    dropped = []

    def mask_without_last_token(mb):  # the last token of every response is padding to the loss
        mask = own_mask(mb).clone()
        mask[:, -1] = 0
        dropped.append(mask)
        return mask

    own_logprobs = grpo._logprobs

    def reference_with_inf(model, mb, chunk):
        out = own_logprobs(model, mb, chunk)
        if not torch.is_grad_enabled():  # the reference's no-grad forward: -inf where the loss mask is 0
            out = out.clone()
            out[:, -1] = -math.inf
        return out

    def spread_advantages(groups):  # a random tiny policy earns equal rewards: give the update a gradient
        for g in groups:
            g.advantages = torch.linspace(-1.0, 1.0, g.size)

    own_update, sums = grpo.update, []
    monkeypatch.setattr(grpo, "advantages", spread_advantages)
    monkeypatch.setattr(grpo, "_loss_mask", mask_without_last_token)
    monkeypatch.setattr(grpo, "_logprobs", reference_with_inf)
    monkeypatch.setattr(grpo, "update", lambda groups, timer: sums.append(own_update(groups, timer)) or sums[-1])
    runner()
    assert dropped and all(bool((m[:, -1] == 0).all()) for m in dropped)
    (out,) = sums
    # at rho = 1 the centred policy term sums to ~0 and the reference equals the policy (kl 0): the loss is ~0, its
    # gradient (-A grad logp) is not
    assert out["tokens"] > 0 and math.isfinite(out["loss"]) and math.isfinite(out["kl"])
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    weights = [p for p in grpo.policy.parameters() if p.requires_grad]
    assert weights and all(bool(torch.isfinite(p).all()) for p in weights)
