"""GRPO and its variants as pure functions on tensors: advantages, clipped policy loss, k3 KL, loss aggregation.
N = sum(G_b) responses to B prompts, the G_b rows of group b contiguous and in order (`group_sizes` [B]); per-token
tensors are [N, S] with a 0/1 completion mask.

Advantage of response i in group g (outcome reward r_i, broadcast over its tokens): A_i = (r_i - mean_g(r)) / s, with
s = std_g(r) + eps ("group": GRPO, arXiv 2402.03300; unbiased std), std(r) + eps over all N ("batch") or 1 ("none":
Dr. GRPO, arXiv 2503.20783). A group of size 1 or with all-equal rewards gets A = 0 exactly.
Policy loss per token, rho = exp(logp - old_logp): l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), with
DAPO's clip-higher (arXiv 2503.14476) when eps_high > eps_low; at rho = 1, l = -A and grad l = -A grad logp.
KL to the reference, k3 (DeepSeekMath eq. 4), d = ref_logp - logp: k3 = exp(d) - d - 1 >= 0.
Aggregation, L_i the token count of row i, T = max_new_tokens: grpo 1/N sum_i 1/L_i sum_t l_it (per-sequence mean),
dapo 1/(sum_i L_i) sum_it l_it (token mean), dr_grpo 1/(N T) sum_it l_it (no length bias). Each is sum(w l) / D with
D additive over row splits, so summing D over micro-batches and ranks gives exactly the one-batch loss
(`loss_denominator`, `aggregate_loss(..., denominator=)`).
Truncated importance sampling (Yao et al. 2025): each token's loss is weighted by w = min(exp(old_logp -
rollout_logp), C), no gradient through w, so the gradient estimates the trainer's pi_old objective though the engine
sampled; with rollout.max_staleness k >= 1 (`mmpg.rl.overlap`) rollout_logp is the k-step-old behaviour policy's and
this is the decoupled PPO objective (AReaL, arXiv 2505.24298). With identical engines w = 1.
Where we depart from the papers: the log-ratio is clamped to [-20, 20] before exp (as verl does), far outside any
clip range, so exp never overflows; masked positions are dropped with `where`, so a NaN in padding never reaches the
loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: far outside any clip range, far from float32 overflow (exp(88))


def _check_groups(n: int, group_sizes: list[int]) -> Tensor:
    """Validate group sizes against N rows; return the group index of every row [N] long (CPU)."""
    sizes = [int(g) for g in group_sizes]
    if len(sizes) == 0 or any(g < 1 for g in sizes):
        raise ValueError(f"group_sizes must be a non-empty list of ints >= 1, got {list(group_sizes)}")
    if sum(sizes) != n:
        raise ValueError(f"group_sizes sum to {sum(sizes)} but there are {n} rows; rows of a group are contiguous "
                         f"and the sizes must cover all of them")
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def _check_loss_type(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes must match, got {shapes}")


def zero_variance_groups(rewards: Tensor, group_sizes: list[int], atol: float = 0.0) -> Tensor:
    """rewards [N] -> [B] bool, True where a group's rewards are all equal (max - min <= atol).

    Such a group has zero advantage everywhere: no gradient (dynamic sampling drops it; logged as a share)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    gid = _check_groups(rewards.shape[0], group_sizes).to(rewards.device)  # [N]
    r = rewards.detach().double()
    hi = r.new_zeros(len(group_sizes)).scatter_reduce(0, gid, r, "amax", include_self=False)  # [B]
    lo = r.new_zeros(len(group_sizes)).scatter_reduce(0, gid, r, "amin", include_self=False)  # [B]
    return (hi - lo) <= atol


def group_advantages(rewards: Tensor, group_sizes: list[int], scale: str = "group", eps: float = 1e-6,
                     batch_std: float | None = None) -> Tensor:
    """rewards [N] -> advantages [N] float32, A_i = (r_i - group mean) / s (s per `scale`, see the module docstring).

    scale="batch": s = `batch_std` + eps when given (the std of the whole global batch, over every rank: `pooled_std`),
    else the std of these N rewards. Groups of size 1 or with all-equal rewards get exactly 0. Computed in float64,
    returned as float32."""
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; allowed: {', '.join(SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n, b = rewards.shape[0], len(group_sizes)
    gid = _check_groups(n, group_sizes).to(rewards.device)  # [N]
    r = rewards.detach().double()  # [N]
    sizes = torch.tensor([float(g) for g in group_sizes], dtype=torch.float64, device=r.device)  # [B]
    mean = r.new_zeros(b).index_add_(0, gid, r) / sizes  # [B]
    centered = r - mean[gid]  # [N]
    if scale == "group":
        var = r.new_zeros(b).index_add_(0, gid, centered ** 2) / (sizes - 1).clamp(min=1)  # [B], unbiased
        adv = centered / (var.sqrt()[gid] + eps)
    elif scale == "batch":
        if batch_std is None:
            batch_std = float(r.std()) if n > 1 else 0.0  # torch.std of one value is NaN
        adv = centered / (batch_std + eps)
    else:
        adv = centered
    flat = zero_variance_groups(rewards, group_sizes)[gid]  # [N]; size-1 groups are flat too
    return torch.where(flat, torch.zeros_like(adv), adv).float()  # where: a 0/0 with eps=0 never leaks


def pooled_std(count: float, total: float, total_sq: float) -> float:
    """The unbiased std of values known by their count, sum and sum of squares (summed over ranks); 0 for one value."""
    if count <= 1:
        return 0.0
    return math.sqrt(max(0.0, (total_sq - total * total / count) / (count - 1)))


def truncation_mask(completion_mask: Tensor, truncated: Tensor) -> Tensor:
    """completion_mask [N, S], truncated [N] bool -> [N, S] mask (same dtype) with truncated rows zeroed.

    DAPO overlong filtering: a response cut at max_new_tokens has no final answer to reward, so it gets no loss."""
    if completion_mask.dim() != 2 or tuple(truncated.shape) != (completion_mask.shape[0],):
        raise ValueError(f"need completion_mask [N, S] and truncated [N], got {tuple(completion_mask.shape)} and "
                         f"{tuple(truncated.shape)}")
    keep = (~truncated.bool()).to(completion_mask.dtype)[:, None]  # [N, 1]
    return completion_mask * keep


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """logp, ref_logp [N, S] -> [N, S] k3 = exp(d) - d - 1, d = ref_logp - logp; >= 0, 0 where equal.

    expm1(d) - d is the same value without the cancellation of exp(d) - 1 at small d."""
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    d = ref_logp - logp
    return torch.expm1(d) - d


def clipped_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float, eps_high: float
                        ) -> tuple[Tensor, Tensor]:
    """logp, old_logp [N, S]; advantages [N] -> (per-token loss [N, S], clipped [N, S] bool).

    loss = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), rho = exp(logp - old_logp). `clipped` marks tokens
    where the clamp branch is strictly smaller: rho is outside the range on the side A pushes it, and the gradient is 0.
    old_logp and advantages are constants (detached). Ties take the unclipped branch, so at rho = 1 the gradient is
    exactly -A * grad logp."""
    _check_same_shape(logp=logp, old_logp=old_logp)
    if logp.dim() != 2 or tuple(advantages.shape) != (logp.shape[0],):
        raise ValueError(f"need logp [N, S] and advantages [N], got {tuple(logp.shape)} and "
                         f"{tuple(advantages.shape)}")
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    log_ratio = (logp - old_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [N, S]
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(ratio.dtype)[:, None]  # [N, 1]
    unclipped = ratio * adv  # [N, S]
    clipped_obj = ratio.clamp(1 - eps_low, 1 + eps_high) * adv  # [N, S]
    clipped = clipped_obj < unclipped
    return -torch.where(clipped, clipped_obj, unclipped), clipped


def loss_token_weights(completion_mask: Tensor, loss_type: str) -> Tensor:
    """completion_mask [N, S] -> [N, S] float32 weights w: loss = sum(w * l) / loss_denominator.

    grpo: mask / L_i (0 for an empty row); dapo, dr_grpo: mask."""
    _check_loss_type(loss_type)
    mask = completion_mask.float()  # [N, S]
    if loss_type == "grpo":
        return mask / mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return mask


def loss_denominator(completion_mask: Tensor, loss_type: str, max_new_tokens: int) -> float:
    """This batch's share of the loss denominator: rows (grpo), tokens (dapo) or rows * max_new_tokens (dr_grpo).

    Additive over row splits: sum it over micro-batches and ranks, pass the total to `aggregate_loss`."""
    _check_loss_type(loss_type)
    if not max_new_tokens >= 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    n_rows = completion_mask.shape[0]
    if loss_type == "grpo":
        return float(n_rows)
    if loss_type == "dapo":
        return float(completion_mask.float().sum().item())
    return float(n_rows * max_new_tokens)


def aggregate_loss(per_token: Tensor, completion_mask: Tensor, loss_type: str, max_new_tokens: int,
                   denominator: float | None = None) -> Tensor:
    """per_token, completion_mask [N, S] -> scalar sum(w * l) / D (module docstring); D = this batch's when None.

    D = 0 (nothing to learn from) gives a zero that still carries the graph, so backward() works on every rank."""
    _check_same_shape(per_token=per_token, completion_mask=completion_mask)
    w = loss_token_weights(completion_mask, loss_type)  # [N, S]
    if denominator is None:
        denominator = loss_denominator(completion_mask, loss_type, max_new_tokens)
    if denominator < 0:
        raise ValueError(f"denominator must be >= 0, got {denominator}")
    kept = torch.where(w != 0, per_token, torch.zeros_like(per_token))  # [N, S]; padding NaN/inf dropped
    total = (w * kept).sum()
    if denominator == 0:
        return kept.sum() * 0
    return total / denominator


def truncated_is_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float, mask: Tensor | None = None) -> Tensor:
    """old_logp, rollout_logp [N, S] -> [N, S] float32 w = min(exp(old_logp - rollout_logp), cap), detached.

    old_logp: the training forward's logprobs of the sampled tokens (pi_old); rollout_logp: the rollout engine's.
    Positions where `mask` [N, S] is 0 get w = 0 (a NaN or inf there never leaks). The log-ratio is clamped at
    log(cap) before exp, so a huge ratio never overflows."""
    _check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    log_ratio = (old_logp.detach().float() - rollout_logp.detach().float()).clamp(max=math.log(cap))
    w = torch.exp(log_ratio)
    if mask is not None:
        _check_same_shape(old_logp=old_logp, mask=mask)
        w = torch.where(mask.bool(), w, torch.zeros_like(w))
    return w
