"""A video shared by its queries: the prompts of one batch that begin alike share that leading part in the packed row.

The prompt puts the video first, so the prompts of one video's queries agree on a long leading part (system text,
video tokens, template words) and differ in a short tail (the question, the assistant header). For a run of adjacent
prompts b_1..b_Q that agree on their first L tokens, with identical visual inputs and positions there, the row holds

    [ shared (L tokens) | tail_1 + r_1,1 | tail_1 + r_1,2 | ... | tail_Q + r_Q,G ]

one "group" of the ordinary layout (`mmpg.grouping.layout`): every row sees the shared part and its own earlier
tokens, exactly what the per-query forward of [prompt_q | r_q,g] computes. Each row keeps the positions of its full
prompt (`adapters.prefix_positions`); the shared part's are the same in every query (checked), which makes sharing
exact. The LM head scores only response tokens (a tail's tokens are inputs, `GroupLayout.row_skip`), and the vision
tower sees each shared video once.

Where this departs from a true three-level tree: each row repeats its query's tail (G copies of ~30 tokens), so no
new attention kernel is needed; the token ceiling is QG(P+t+S)/(P+QG(t+S)) against per-query grouping's
G(P+t+S)/(P+t+GS) (docs/performance.md, "One video, three questions"). A video's prompts anywhere in a batch are
first brought side by side (`share_order`: the grouped forward and the rollout engine compute in that order and give
results back in the caller's); a lone prompt is packed as a group whose shared part is the whole prompt, no tail.
"""

from __future__ import annotations

import dataclasses

import torch

from mmpg.grouping.inputs import merge_visuals


@dataclasses.dataclass(frozen=True)
class Share:
    """Prompts `prompts` (adjacent, in order) packed behind one shared part of `length` tokens."""

    prompts: tuple[int, ...]
    length: int


def _same_visuals(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _common_length(ids_a: torch.Tensor, ids_b: torch.Tensor) -> int:
    n = min(ids_a.numel(), ids_b.numel())
    differ = (ids_a[:n] != ids_b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def packed_tokens(lengths: list[int], groups: list[int], shared: int) -> int:
    """Prompt tokens a run puts in the packed row: each prompt once (alone), or the shared part once and each row's
    tail, P_q - L, once per response (shared). The responses' own tokens are the same either way."""
    if len(lengths) == 1:
        return lengths[0]
    return shared + sum(g * (n - shared) for n, g in zip(lengths, groups))


def share_order(visuals: list[dict]) -> list[int]:
    """An order of the B prompts that puts the prompts of one video side by side, wherever they sit in the batch:
    videos (or images) in order of first appearance, each one's prompts in the caller's order; prompts without
    visual inputs stay where they are among them. [A q1, A q2, B, A q3, B q2] -> [0, 1, 3, 2, 4]. The identity when
    the batch already keeps each video's prompts together."""
    groups: list[list[int]] = []
    for b, v in enumerate(visuals):
        home = next((g for g in groups if v and _same_visuals(visuals[g[0]], v)), None)
        if home is None:
            groups.append([b])
        else:
            home.append(b)
    return [b for g in groups for b in g]


def find_shares(prefixes, visuals: list[dict], banned: list[int], group_sizes: list[int]) -> list[Share]:
    """Runs of adjacent prompts that share a leading part: identical visual inputs, identical token ids and positions
    over that part, every tail at least one token long (and free of image/video placeholders), and fewer tokens
    packed than without sharing (tails are repeated per response, `packed_tokens`: a long video shared by short
    questions pays off, a 3-token chat header before different questions does not). Singletons get the whole prompt
    as their part. Found from the inputs alone, with no hint from the caller. `visuals`: each prompt's visual inputs
    (`split_visuals_per_prompt`; empty dicts for a text model); `banned`: the image/video placeholder ids."""
    ids, positions = prefixes.ids, prefixes.positions
    lens = [t.numel() for t in ids]
    banned = torch.tensor(banned, dtype=torch.long)
    shares: list[Share] = []
    run, length = [0], ids[0].numel()
    for b in range(1, len(ids)):
        lead = run[0]
        common = _common_length(ids[lead], ids[b]) if _same_visuals(visuals[lead], visuals[b]) else 0
        common = min(common, length, ids[b].numel() - 1, min(ids[q].numel() for q in run) - 1)
        if common > 0:
            agree = (positions[lead][:, :common] == positions[b][:, :common]).all(dim=0)
            common = int(agree.numel() if bool(agree.all()) else agree.int().argmin())
        grown = run + [b]
        saves = packed_tokens([lens[q] for q in grown], [group_sizes[q] for q in grown], common) < \
            packed_tokens([lens[q] for q in run], [group_sizes[q] for q in run], length) + lens[b]
        if common > 0 and saves and not any(bool(torch.isin(ids[q][common:].cpu(), banned).any()) for q in grown):
            run, length = grown, common
            continue
        shares.append(Share(tuple(run), length if len(run) > 1 else ids[run[0]].numel()))
        run, length = [b], ids[b].numel()
    shares.append(Share(tuple(run), length if len(run) > 1 else ids[run[0]].numel()))
    return shares


def pack_shares(prefixes, completions, shares: list[Share], device, row_positions: list | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Packed ids [T], positions [A, T], and per share the row lengths (tail + response) and the tails' lengths.
    row_positions[i]: completion row i's own positions [A, L_i] (a row holding a clip's frames,
    `adapters.completion_positions`), None: its prompt's start, then one more per token."""
    ids, pos, row_lens, row_skip = [], [], [], []
    for share in shares:
        lead, n = share.prompts[0], share.length
        ids.append(prefixes.ids[lead][:n].to(device))
        pos.append(prefixes.positions[lead][:, :n].to(device))
        lens, skips = [], []
        for b in share.prompts:
            tail_ids, tail_pos = prefixes.ids[b][n:].to(device), prefixes.positions[b][:, n:].to(device)
            start = prefixes.starts[b]
            for i in completions.rows_of(b):
                tokens = completions.tokens(i).to(device)
                ids += [tail_ids, tokens]
                own = row_positions[i] if row_positions is not None else None
                pos += [tail_pos, own.to(device) if own is not None else
                        (start + torch.arange(tokens.numel(), device=device)).expand(tail_pos.shape[0], -1)]
                lens.append(tail_ids.numel() + tokens.numel())
                skips.append(tail_ids.numel())
        row_lens.append(lens)
        row_skip.append(skips)
    return torch.cat(ids), torch.cat(pos, dim=1), row_lens, row_skip


def leaders_visuals(prompt_inputs, visuals: list[dict], shares: list[Share], completions=None,
                    row_visuals: list[dict] | None = None) -> dict:
    """The visual inputs in the packed row's placeholder order: each share's first prompt's only (the row holds
    each shared video once), and behind it the clips inside its rows' completions (`row_visuals`, a trajectory's
    zoom frames), row by row."""
    clips = row_visuals is not None and any(row_visuals)
    if not clips and (all(len(s.prompts) == 1 for s in shares) or not any(visuals)):
        return prompt_inputs
    items = []
    for s in shares:
        items.append(visuals[s.prompts[0]])
        if clips:
            items += [row_visuals[i] for b in s.prompts for i in completions.rows_of(b)]
    return merge_visuals(items)
