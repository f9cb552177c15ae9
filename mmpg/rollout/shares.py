"""A video shared by its queries, in the rollout: which prompts share a leading part, and the one packed prefill.

Which prompts share: `mmpg.grouping.shares.find_shares`, the training forward's rule — runs of ADJACENT prompts with
identical visual inputs and identical token ids and positions over a leading part of L tokens, every tail (the rest
of a prompt, P_q - L >= 1 tokens) free of image/video placeholders — found from the inputs alone.

Cost rule (where it departs from training): the training forward repeats a query's tail once per response, so it
shares only where L + Σ_q G_q (P_q - L) < Σ_q G_q P_q. Decoding prefills a tail once per query and its G_q rows read
it from the cache, so here a run is asked with group sizes of 1: Q prompts sharing L tokens prefill
L + Σ_q (P_q - L) = Σ_q P_q - (Q - 1) L tokens, and every decode step reads (Q - 1) L fewer prefix keys per row group.
That saves for any L > 0, but sharing costs one more attention call per layer per decode step (the tails level,
`mmpg.rollout.cascade`), so a share is kept only when what it shares is worth that: a video or an image (the vision
tower and hundreds to thousands of tokens), or at least `MIN_TEXT_SHARED` tokens of text. A 3-token chat header
before different questions is not shared, and a batch without shares takes the plain cascade path unchanged.

The packed prefill (one forward, also under synced ZeRO-3 decoding: the same forwards as the plain prefill):

    [ shared_1 | tail_1,1 | tail_1,2 | ... | shared_2 | tail_2,1 | ... ]      GroupLayout(prefix_lens=[L_s],
                                                                               response_lens=[[P_q - L_s for q in s]])

Under mmpg's grouped attention a tail token sees its share's shared part and its own earlier tail tokens, exactly
what the per-query prefill of [prompt_q] computes there (and the shared part's tokens see only the shared part, as in
every query). Each token keeps the position of its own full prompt (`adapters.prefix_positions`; over the shared part
they agree, `find_shares` checks). The vision tower sees each shared video once (the leaders' visual inputs). A prompt
that shares with no other, in a batch that shares elsewhere, gets L = P - 1 (its last token is its tail), so every
query has a tail and every row the same three cascade levels; a batch holding a one-token prompt is not shared.
"""

from __future__ import annotations

import dataclasses

import torch

from mmpg.grouping.adapters import Prefixes
from mmpg.grouping.backends import compute_dtype, resolve_backend
from mmpg.grouping.inputs import VIDEO_DEEPSTACK, VIDEO_FEATURES, placeholder_token_ids
from mmpg.grouping.layout import GroupLayout
from mmpg.grouping.patch import grouping_state
from mmpg.grouping.shares import Share, find_shares
from mmpg.rollout.cascade import ShareSplit

MIN_TEXT_SHARED = 64  # least shared text tokens (no video or image in the shared part) for a share to be kept

# the videos may come as their features (`mmpg.grouping.sequence.with_video_features`) instead of pixels
_VISUAL_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", VIDEO_FEATURES,
                VIDEO_DEEPSTACK)


@dataclasses.dataclass
class SharedPrefill:
    """One packed prefill of a batch whose prompts share leading parts."""

    shares: list[Share]  # [S] every prompt in exactly one share, in order; `length` = its shared part L_s
    ids: torch.Tensor  # [T] the packed row
    positions: torch.Tensor  # [A, T] each token's position in its full prompt (A = 3 mRoPE, 1 text)
    layout: GroupLayout  # shared parts as prefixes, tails as their responses
    split: ShareSplit  # where each level's keys sit in the row (for `SharedPrefixCache.expect_shares`)
    last: torch.Tensor  # [B] row position of each prompt's last token (its token-0 logits)
    visuals: dict  # the forward's visual inputs: each share leader's only (a shared video once)


def decode_shares(model, prefixes: Prefixes, visuals: list[dict] | None) -> list[Share] | None:
    """The shares a batch is decoded with (module docstring), or None when no two prompts share (the plain path).
    visuals: each prompt's visual inputs (`split_visuals_per_prompt`), None for a text model."""
    n = len(prefixes.ids)
    if n < 2:
        return None
    visuals = visuals or [{} for _ in range(n)]
    shares = []
    for s in find_shares(prefixes, visuals, placeholder_token_ids(model), [1] * n):
        worth = bool(visuals[s.prompts[0]]) or s.length >= MIN_TEXT_SHARED
        shares += [s] if len(s.prompts) > 1 and worth else [Share((b,), prefixes.ids[b].numel()) for b in s.prompts]
    if all(len(s.prompts) == 1 for s in shares) or min(p.numel() for p in prefixes.ids) < 2:
        return None
    # a prompt alone: its first P - 1 tokens are its shared part, its last token its tail
    return [s if len(s.prompts) > 1 else Share(s.prompts, s.length - 1) for s in shares]


def _left_padded(spans: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, length) per entry -> row positions [E, L_max] left-padded (pads repeat the entry's first position, a
    real key, so the gathered K/V stays finite) and the mask [E, L_max], True on real keys."""
    width = max(n for _, n in spans)
    starts = torch.tensor([s for s, _ in spans], device=device)[:, None]
    pad = torch.tensor([width - n for _, n in spans], device=device)[:, None]
    offs = torch.arange(width, device=device)[None, :]
    return starts + (offs - pad).clamp(min=0), offs >= pad


def shared_prefill(model, prefixes: Prefixes, visuals: list[dict] | None, shares: list[Share], device) -> SharedPrefill:
    """The packed row of `shares` on `device` (module docstring)."""
    ids, pos, prefix_lens, tail_lens, shared_spans, tail_spans, query_share = [], [], [], [], [], [], []
    at = 0
    for s_idx, share in enumerate(shares):
        lead, n = share.prompts[0], share.length
        ids.append(prefixes.ids[lead][:n])
        pos.append(prefixes.positions[lead][:, :n])
        shared_spans.append((at, n))
        at += n
        lens = []
        for b in share.prompts:
            ids.append(prefixes.ids[b][n:])
            pos.append(prefixes.positions[b][:, n:])
            lens.append(prefixes.ids[b].numel() - n)
            tail_spans.append((at, lens[-1]))
            query_share.append(s_idx)
            at += lens[-1]
        prefix_lens.append(n)
        tail_lens.append(lens)
    shared_index, shared_mask = _left_padded(shared_spans, device)
    tail_index, tail_mask = _left_padded(tail_spans, device)
    split = ShareSplit(shared_index, shared_mask, tail_index, tail_mask, torch.tensor(query_share, device=device))
    backend = resolve_backend(grouping_state(model).backend, device, compute_dtype(model, device))
    layout = GroupLayout(prefix_lens=prefix_lens, response_lens=tail_lens, device=device, backend=backend)
    leaders = {}
    for share in shares:
        for k, v in (visuals[share.prompts[0]] if visuals else {}).items():
            if k in _VISUAL_KEYS:
                leaders.setdefault(k, []).append(v.to(device))
    leaders = {k: torch.cat(v) for k, v in leaders.items()}
    layout.model_inputs = tuple(leaders)  # the grouped attention's tripwire: none of them may reach it
    last = torch.tensor([a + n - 1 for a, n in tail_spans], device=device)
    return SharedPrefill(shares, torch.cat(ids).to(device), torch.cat(pos, dim=1).to(device), layout, split, last,
                       leaders)


def shared_batches(prefill: SharedPrefill, pad_id: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The chunked form of a shared prefill (`HFEngine._prefill_shared_chunked`): the shared parts as a left-padded
    batch (ids [S, L_s], attention mask [S, L_s], positions [A, S, L_s]) and the tails as one (ids [Q, L_t],
    positions [A, Q, L_t]), padded exactly as `prefill.split` pads the cache's two levels (pad ids `pad_id`, position
    0). The packed row's grouped attention gives a tail token its share's shared part and its own earlier tail
    tokens; the shared parts prefilled first (in chunks) and then the tails behind them give it the same keys."""
    def batch(index, mask):
        ids = torch.where(mask, prefill.ids[index], torch.full_like(index, pad_id))
        return ids, mask.long(), prefill.positions[:, index] * mask

    split = prefill.split
    shared = batch(split.shared_index, split.shared_mask)
    ids, _, pos = batch(split.tail_index, split.tail_mask)
    return shared, (ids, pos)


def prefill_stats(prefixes: Prefixes, shares: list[Share] | None) -> dict:
    """`HFEngine.last_stats`: prompts B; prefixes, the prefills of a leading part (one per share, B without sharing);
    prefix_tokens, prompt tokens prefilled (each shared part once plus the tails); shared_prompts, prompts prefilled
    behind another prompt's shared part (B - prefixes)."""
    lengths = [p.numel() for p in prefixes.ids]
    if shares is None:
        return {"prompts": len(lengths), "prefixes": len(lengths), "prefix_tokens": sum(lengths), "shared_prompts": 0}
    saved = sum((len(s.prompts) - 1) * s.length for s in shares)
    return {"prompts": len(lengths), "prefixes": len(shares), "prefix_tokens": sum(lengths) - saved,
            "shared_prompts": len(lengths) - len(shares)}
