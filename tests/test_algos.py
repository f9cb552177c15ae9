"""GRPO algorithm pieces against values worked out by hand (the arithmetic is in the comment next to each value)."""

import math

import pytest
import torch

from mmpg.rl.algos import (LOSS_TYPES, aggregate_loss, clipped_policy_loss, group_advantages, kl_k3,
                           loss_denominator, loss_token_weights, pooled_std, truncation_mask, zero_variance_groups)

# Three groups: [1, 0, 0, 1] (mixed), [2, 2] (all equal), [0.5] (size 1).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 0.5])
SIZES = [4, 2, 1]


def _close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"max diff {(actual - expected).abs().max()}"


# ---------------------------------------------------------------- advantages

def test_advantages_group_scale():
    # group 1: mean 0.5, centered [.5, -.5, -.5, .5]; unbiased var = 4 * 0.25 / 3 = 1/3, std = 1/sqrt(3)
    #   -> A = +-0.5 * sqrt(3) = +-0.8660254; groups 2 and 3 -> exactly 0
    h = 0.5 * math.sqrt(3)
    adv = group_advantages(REWARDS, SIZES, scale="group", eps=0.0)
    assert adv.dtype == torch.float32
    _close(adv, [h, -h, -h, h, 0, 0, 0])
    assert torch.equal(adv[4:], torch.zeros(3))  # exact zeros, no NaN even with eps = 0
    # default eps = 1e-6 only shifts the value by ~ 0.866 * 1e-6 / 0.577 = 1.5e-6
    _close(group_advantages(REWARDS, SIZES), [h, -h, -h, h, 0, 0, 0], atol=1e-5)


def test_advantages_batch_scale():
    # all 7 rewards, doubled: [2, 0, 0, 2, 4, 4, 1], sum 13, sum of squares 41 -> SS = 41 - 13^2/7 = 118/7;
    # in original units SS = 118/28 = 59/14, unbiased var = 59/14 / 6 = 59/84, std = 0.8380817
    # group 1 centered by its own mean: +-0.5 -> A = +-0.5 / 0.8380817 = +-0.5966
    a = 0.5 / math.sqrt(59 / 84)
    assert a == pytest.approx(0.59660, abs=1e-5)
    adv = group_advantages(REWARDS, SIZES, scale="batch", eps=0.0)
    _close(adv, [a, -a, -a, a, 0, 0, 0])
    assert torch.equal(adv[4:], torch.zeros(3))


def test_batch_std_from_every_rank_sums():
    # the trainer sums count, sum and sum of squares over ranks and passes the pooled std: split the 7 rewards over
    # two "ranks" and the advantages equal the one-batch ones
    r = REWARDS.double()
    parts = [r[:3], r[3:]]
    sums = [sum(float(f(p)) for p in parts) for f in (torch.numel, torch.sum, lambda p: (p ** 2).sum())]
    std = pooled_std(*sums)
    assert std == pytest.approx(math.sqrt(59 / 84), rel=1e-12)
    assert torch.equal(group_advantages(REWARDS, SIZES, scale="batch", eps=0.0, batch_std=std),
                       group_advantages(REWARDS, SIZES, scale="batch", eps=0.0))
    assert pooled_std(1, 3.0, 9.0) == 0.0 and pooled_std(0, 0.0, 0.0) == 0.0


def test_advantages_no_scale():
    # Dr. GRPO: just r - group mean
    _close(group_advantages(REWARDS, SIZES, scale="none"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_degenerate_groups_are_exact_zeros(scale):
    # 0.1 * 3 / 3 != 0.1 in float: without the explicit zeroing, centered = 1e-17 and / (1e-17 + eps) leaks
    r = torch.tensor([0.1, 0.1, 0.1, 3.0], dtype=torch.float64)
    adv = group_advantages(r, [3, 1], scale=scale, eps=0.0)
    assert torch.equal(adv, torch.zeros(4))
    one = group_advantages(torch.tensor([3.0]), [1], scale=scale, eps=0.0)  # N = 1: torch.std would be NaN
    assert torch.equal(one, torch.zeros(1))


def test_advantages_errors():
    with pytest.raises(ValueError, match="group.*batch.*none"):
        group_advantages(REWARDS, SIZES, scale="std")
    with pytest.raises(ValueError, match="sum to 6 but there are 7 rows"):
        group_advantages(REWARDS, [3, 3])
    with pytest.raises(ValueError, match=">= 1"):
        group_advantages(REWARDS, [4, 0, 3])
    with pytest.raises(ValueError, match=">= 1"):
        zero_variance_groups(REWARDS, [8, -1])


# ---------------------------------------------------------------- group selection

def test_zero_variance_groups():
    assert zero_variance_groups(REWARDS, SIZES).tolist() == [False, True, True]
    r = torch.tensor([1.0, 1.05, 3.0, 0.0])
    assert zero_variance_groups(r, [2, 2], atol=0.1).tolist() == [True, False]  # 0.05 <= 0.1, 3 > 0.1
    assert zero_variance_groups(r, [2, 2]).tolist() == [False, False]


def test_truncation_mask():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = truncation_mask(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert out.dtype == mask.dtype


# ---------------------------------------------------------------- KL

def test_kl_k3_values():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.3]]))
    # ref/p = 0.5: 0.5 - ln 0.5 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # ref/p = 2:   2 - ln 2 - 1     = 2 - 0.693147 - 1   = 0.306853
    # equal: 1 - 0 - 1 = 0
    _close(kl_k3(logp, ref), [[0.193147, 0.306853, 0.0]])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    assert (kl_k3(a, b) >= 0).all()


# ---------------------------------------------------------------- clipped policy loss

def test_clipped_policy_loss_hand_values_and_gradients():
    eps_low, eps_high = 0.2, 0.28  # range [0.8, 1.28]
    ratio = torch.tensor([[1.5, 1.1, 0.5],
                          [0.5, 1.5, 0.9]])
    old = torch.log(torch.tensor([[0.3, 0.2, 0.6], [0.4, 0.1, 0.5]]))
    logp = (old + ratio.log()).requires_grad_()
    adv = torch.tensor([2.0, -1.0])
    loss, clipped = clipped_policy_loss(logp, old, adv, eps_low, eps_high)
    # A = +2:  rho 1.5 -> min(3.0, 1.28*2 = 2.56) = 2.56, clamp branch: loss -2.56, clipped, grad 0
    #          rho 1.1 -> inside: loss -2.2, grad -A rho = -2.2
    #          rho 0.5 -> min(1.0, 0.8*2 = 1.6) = 1.0, unclipped: loss -1.0, grad -A rho = -1.0
    # A = -1:  rho 0.5 -> min(-0.5, 0.8*-1 = -0.8) = -0.8, clamp branch: loss 0.8, clipped, grad 0
    #          rho 1.5 -> min(-1.5, -1.28) = -1.5, unclipped: loss 1.5, grad -A rho = 1.5
    #          rho 0.9 -> inside: loss 0.9, grad 0.9
    _close(loss.detach(), [[-2.56, -2.2, -1.0], [0.8, 1.5, 0.9]])
    assert clipped.tolist() == [[True, False, False], [True, False, False]]
    loss.sum().backward()
    _close(logp.grad, [[0.0, -2.2, -1.0], [0.0, 1.5, 0.9]])


def test_clipped_policy_loss_on_policy_is_plain_policy_gradient():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 5, generator=g).requires_grad_()
    adv = torch.tensor([1.5, -0.5, 0.0])
    loss, clipped = clipped_policy_loss(logp, logp.detach(), adv, 0.2, 0.28)
    # rho = 1 everywhere: loss = -A, d loss / d logp = -A * rho = -A
    expected = (-adv)[:, None].expand(3, 5)
    _close(loss.detach(), expected)
    assert not clipped.any()
    loss.sum().backward()
    _close(logp.grad, expected)


def test_clipped_policy_loss_extreme_ratio_stays_finite():
    logp, old = torch.tensor([[0.0, -1e4]]), torch.tensor([[-1e4, 0.0]])  # log-ratio +-1e4: exp would overflow
    loss, _ = clipped_policy_loss(logp, old, torch.tensor([0.0]), 0.2, 0.2)
    assert torch.isfinite(loss).all() and torch.equal(loss, torch.zeros(1, 2))


# ---------------------------------------------------------------- aggregation

# Row 0 has 3 tokens [1, 2, 3], row 1 has 1 token [4]; the masked 100s must not count. max_new_tokens T = 5.
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("loss_type,denominator,expected,grad", [
    # grpo: row means 6/3 = 2 and 4/1 = 4, mean over 2 rows = 3; d/dl = 1/(L_i N): 1/6 on row 0, 1/2 on row 1
    ("grpo", 2.0, 3.0, [[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0]]),
    # dapo: (1 + 2 + 3 + 4) / 4 tokens = 2.5; d/dl = 1/4 on every token
    ("dapo", 4.0, 2.5, [[1 / 4, 1 / 4, 1 / 4, 0], [1 / 4, 0, 0, 0]]),
    # dr_grpo: 10 / (2 rows * T = 5) = 1.0; d/dl = 1/10 on every token
    ("dr_grpo", 10.0, 1.0, [[1 / 10, 1 / 10, 1 / 10, 0], [1 / 10, 0, 0, 0]]),
])
def test_aggregate_hand_values(loss_type, denominator, expected, grad):
    assert loss_denominator(MASK, loss_type, 5) == denominator
    per_token = PER_TOKEN.clone().requires_grad_()
    loss = aggregate_loss(per_token, MASK, loss_type, 5)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    _close(per_token.grad, grad)


def test_loss_token_weights_empty_row_and_padding_nan():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])  # row 1 fully masked (e.g. truncated)
    w = loss_token_weights(mask, "grpo")
    assert w.dtype == torch.float32
    _close(w, [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    per_token = torch.tensor([[2.0, 4.0, float("nan")], [float("inf"), 1.0, 1.0]])
    # grpo: (2 + 4)/2 = 3 for row 0, 0 for row 1, / 2 rows = 1.5; dapo: 6 / 2 tokens = 3; dr_grpo: 6 / (2 * 4) = 0.75
    assert aggregate_loss(per_token, mask, "grpo", 4).item() == pytest.approx(1.5)
    assert aggregate_loss(per_token, mask, "dapo", 4).item() == pytest.approx(3.0)
    assert aggregate_loss(per_token, mask, "dr_grpo", 4).item() == pytest.approx(0.75)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_zero_denominator_keeps_graph(loss_type):
    per_token = torch.randn(2, 3).requires_grad_()
    mask = torch.zeros(2, 3, dtype=torch.long)
    loss = aggregate_loss(per_token, mask, loss_type, 3, denominator=0.0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(per_token.grad, torch.zeros(2, 3))
    if loss_type == "dapo":  # its own denominator is 0 tokens
        assert aggregate_loss(per_token, mask, loss_type, 3).item() == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_is_additive_over_row_splits(loss_type):
    g = torch.Generator().manual_seed(2)
    per_token = torch.randn(5, 7, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 0, 5, 1])  # unequal, one empty row
    mask = (torch.arange(7)[None, :] < lengths[:, None]).long()  # [5, 7]
    whole = aggregate_loss(per_token, mask, loss_type, 8)
    parts = [slice(0, 2), slice(2, 3), slice(3, 5)]  # the middle part is the empty row alone
    total = sum(loss_denominator(mask[p], loss_type, 8) for p in parts)
    assert total == loss_denominator(mask, loss_type, 8)
    split = sum(aggregate_loss(per_token[p], mask[p], loss_type, 8, denominator=total) for p in parts)
    assert abs(split.item() - whole.item()) <= 1e-7


def test_loss_type_errors():
    for call in (lambda: loss_token_weights(MASK, "ppo"), lambda: loss_denominator(MASK, "ppo", 5),
                 lambda: aggregate_loss(PER_TOKEN, MASK, "ppo", 5)):
        with pytest.raises(ValueError, match="grpo, dapo, dr_grpo"):
            call()
