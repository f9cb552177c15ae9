"""Choosing the next token from one step's logits: temperature, then top-k, then top-p (transformers' order).

Two distributions are involved and kept apart on purpose:

    logits [n, V] --/T--> policy logits ----top-k, top-p----> sampling distribution  (what the token is drawn from)
                              |
                              +--> log_softmax at the chosen token = the returned logprob

The returned logprob is the *policy* logprob under temperature T, log softmax(logits / T)[token], without the top-k /
top-p truncation: it is what `grouped_logprobs(..., temperature=T)` recomputes on the same responses, i.e. what the
GRPO ratio and KL need. (The truncated distribution's logprob would differ from any recompute whenever a filter
removed mass, which is the rollout/recompute mismatch reported for other frameworks.) Greedy decoding
(temperature 0) takes the argmax of the raw logits and returns log softmax(logits)[token], the policy at T = 1.
"""

from __future__ import annotations

import torch


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[n, V] -> [n, V] with everything below the k-th largest value set to -inf (k = 0: no filter). Ties with the
    k-th value are kept, as transformers' TopKLogitsWarper keeps them."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """[n, V] -> [n, V] keeping the smallest set of most likely tokens whose probability reaches p (p = 1: no
    filter); the most likely token is always kept. Same rule as transformers' TopPLogitsWarper."""
    if p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= 1 - p
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None, banned: torch.Tensor | None = None,
                uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. logits [n, V] (any float dtype) -> (tokens [n] long, policy logprobs [n] float32).

    temperature 0 is greedy. Rows are sampled independently; all randomness comes from `generator`, or, when
    `uniforms` [n] in [0, 1) is given, from those numbers by inverse-CDF sampling (one per row: the caller draws them
    from per-row generators, so a row's tokens do not depend on which other rows share the batch). `banned` ids
    (e.g. a VL model's image/video placeholders, which no response may contain) are never chosen; like the top-k /
    top-p filters this only shapes the sampling distribution, the returned logprob stays the untruncated policy's."""
    logits = logits.float()
    if temperature == 0:
        tokens = _ban(logits, banned).argmax(dim=-1)
        return tokens, _logprob_at(logits, tokens)
    policy = logits / temperature if temperature != 1.0 else logits
    filtered = filter_top_p(filter_top_k(_ban(policy, banned), top_k), top_p)
    probs = filtered.softmax(dim=-1)
    if uniforms is None:
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    else:  # the first token of positive probability whose cumulative probability exceeds u
        cum = probs.cumsum(dim=-1)
        u = uniforms.to(cum.device, cum.dtype)[:, None] * cum[:, -1:]
        # A float64 uniform near 1 can round to u == cum[-1] in float32, where no token exceeds it: take the last
        # token of positive probability then (not id V - 1, which may be banned or filtered out).
        positive = probs > 0
        above = (cum > u) & positive
        last = probs.shape[-1] - 1 - positive.flip(-1).int().argmax(dim=-1)
        tokens = torch.where(above.any(dim=-1), above.int().argmax(dim=-1), last)
    return tokens, _logprob_at(policy, tokens)


def _ban(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    return logits if banned is None or banned.numel() == 0 else logits.index_fill(-1, banned, float("-inf"))


def _logprob_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, V], [n] -> [n] log softmax(logits) at tokens, computed as grouped_logprobs computes it."""
    return logits.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
