"""Multi-turn rollouts with the zoom tool: G trajectories per prompt, each a branch of model turns and tool turns.

    turn 1      the engine samples G responses per prompt as always (the overview prompt prefilled once)
    tool turn   each response that calls the tool gets the tool's turn (`mmpg.rollout.zoom.ZoomEnvironment`): a
                window's frames, or an error line; a response that answers, is cut at max_new_tokens, or calls
                past `max_turns` ends its trajectory
    turn k + 1  every branch still going continues from its whole conversation: [prompt | turns so far | tool turn]
                is its prompt (the overview's visual inputs, then its clips), one response each

A branch's completion is everything after the prompt, in order: the model's turns and the tool turns between them
(`Trajectories.completion_ids`); `own_mask` marks the model's own tokens (what a loss covers), `completion_visuals`
each row's clips, as the grouped forward's trajectory tree takes them (`mmpg.grouping`, `completion_visuals`). The
logprobs of the model's tokens are the engine's, each under the whole conversation before it, so they equal the
grouped forward's at those tokens (tests/test_zoom_rollout.py).

The HF engine keeps the K/V between turns (`HFEngine.generate_branches` / `continue_branches`, cascade decoding; on
several ranks their turns in lockstep, `HFEngine.idle_turn` for a rank whose branches have ended): the overview is
prefilled once for the whole trajectory tree, turn k + 1 feeds each branch's tool turn (the clip's frames through
the vision tower, its tokens) as one chunk behind the branch's own K/V, and every decode step reads each prompt's
overview once for all its branches (`mmpg.rollout.cascade`). Elsewhere (the copy decoding, `keep_turns=False`, an
engine without branches) each turn asks the engine anew: the branches of turn k + 1 are new prompts whose overview
the engine prefills again. Both give the same tokens (tests/test_zoom_rollout.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from mmpg.grouping.inputs import merge_visuals, mm_token_type_ids, pad_prompts, pad_token_id, prompts_alone
from mmpg.models.vision_calls import prefill_tokens
from mmpg.rollout.engine import FINISH_STOP, RolloutEngine, SamplingParams, group_sizes_for
from mmpg.rollout.zoom import ToolTurn, ZoomEnvironment, turn_inputs


@dataclasses.dataclass
class Trajectories:
    """N = sum(group_sizes) trajectories, rows of prompt b contiguous (as `Rollout`)."""

    completion_ids: torch.Tensor  # [N, S] every token after the prompt: model turns and tool turns, right-padded
    completion_mask: torch.Tensor  # [N, S] 1 on the row's tokens, then 0
    own_mask: torch.Tensor  # [N, S] 1 on the model's own tokens (the loss's), 0 on tool turns and padding
    completion_visuals: list[dict]  # [N] each row's clips ({} without), `grouped_forward(completion_visuals=)`
    group_sizes: list[int]
    turns: list[list[str]]  # [N] each model turn's decoded text
    tools: list[list[ToolTurn]]  # [N] each tool turn (a window, its frame and token counts, or an error)
    finish_reasons: list[str]  # [N] of the last model turn: FINISH_STOP or FINISH_LENGTH
    logprobs: torch.Tensor | None = None  # [N, S] the engine's logprobs of the model's tokens, 0 elsewhere
    prefix_tokens: int = 0  # tokens the engine prefilled over every turn (`mmpg.models.vision_calls.prefill_tokens`)

    @property
    def texts(self) -> list[str]:
        """[N] each row's last model turn: its answer (what the grounding reward reads), or its last call."""
        return [row[-1] if row else "" for row in self.turns]

    @property
    def zooms(self) -> list[int]:
        """[N] tool turns that returned a clip."""
        return [sum(t.window is not None for t in row) for row in self.tools]


def _continuations(model, alone: list[dict], rows: list[int], prompt_of: list[int],
                   history: list[list[torch.Tensor]], clips: list[list[dict]], pad_id: int) -> dict:
    """Processor-style inputs of the branches `rows`: each one's prompt (`alone`: `prompts_alone` of the batch), then
    its history (turns and tool turns), the prompt's visual inputs followed by its clips; left-padded."""
    out = []
    for i in rows:
        base = alone[prompt_of[i]]
        hist = torch.cat(history[i])[None]  # [1, H]
        one = {"input_ids": torch.cat([base["input_ids"], hist], dim=1)}
        if "attention_mask" in base:
            one["attention_mask"] = torch.ones_like(one["input_ids"])
        if "mm_token_type_ids" in base:
            types = mm_token_type_ids(model, {"input_ids": hist}).to(base["mm_token_type_ids"].dtype)
            one["mm_token_type_ids"] = torch.cat([base["mm_token_type_ids"], types], dim=1)
        visuals = {k: v for k, v in base.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        one.update(merge_visuals([visuals, *clips[i]]) if clips[i] else visuals)
        out.append(one)
    return pad_prompts(out, pad_id)


def _videos(videos, rows: list[int], prompt_of: list[int], tools: list[list[ToolTurn]]) -> list | None:
    """The decoded videos of the branches `rows`' conversations: the prompt's, then each clip, in order."""
    if videos is None:
        return None
    out = []
    for i in rows:
        clips = [t.clip for t in tools[i] if t.clip is not None]
        overview = videos[prompt_of[i]]
        out.append(([overview] if overview is not None else []) + clips or None)
    return out


def sample_trajectories(engine: RolloutEngine, model, processor, prompt_inputs, samples: Sequence,
                        group_size: int | Sequence[int], env: ZoomEnvironment, sampling: SamplingParams | None = None,
                        *, prompt_seeds: Sequence[int] | None = None, all_done=None,
                        videos: Sequence | None = None) -> Trajectories:
    """G_b zoom trajectories for each of the B prompts (module docstring). samples: the B prompts' samples (their
    video files and shown windows, for the tool). prompt_seeds: as `RolloutEngine.generate_groups`'s; turn k of
    row j of prompt b is then seeded by (prompt_seeds[b], j, k), so a branch does not depend on the others.
    all_done(this_rank_done) -> whether every rank is done (ranks in lockstep under ZeRO-3, which gathers weights in
    every forward): a rank whose branches have all ended while another's go on samples a stand-in turn (its first
    branch again, the result discarded) for each turn the others take; None: one process. videos: the B prompts'
    decoded videos, for an engine that samples from the frames (`generate_groups(videos=)`, the vLLM engine): a
    later turn's conversation sends its prompt's video, then its clips."""
    sampling = sampling or SamplingParams()
    sizes = group_sizes_for(group_size, int(prompt_inputs["input_ids"].shape[0]))
    if len(samples) != len(sizes):
        raise ValueError(f"{len(samples)} samples for {len(sizes)} prompts; give one per prompt")
    pad_id = pad_token_id(model)
    branches = None
    if hasattr(engine, "generate_branches"):
        first, branches = engine.generate_branches(prompt_inputs, sizes, sampling, prompt_seeds=prompt_seeds)
    else:
        first = engine.generate_groups(prompt_inputs, sizes, sampling, prompt_seeds=prompt_seeds, videos=videos)
    prefilled = prefill_tokens(engine, prompt_inputs)
    n = sum(sizes)
    prompt_of = [b for b, g in enumerate(sizes) for _ in range(g)]
    row_in_group = [j for g in sizes for j in range(g)]
    history: list[list[torch.Tensor]] = [[] for _ in range(n)]
    own: list[list[torch.Tensor]] = [[] for _ in range(n)]
    logps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    clips: list[list[dict]] = [[] for _ in range(n)]
    turns: list[list[str]] = [[] for _ in range(n)]
    tools: list[list[ToolTurn]] = [[] for _ in range(n)]
    finish = [""] * n

    def take(rows: list[int], out) -> None:
        for k, i in enumerate(rows):
            length = int(out.completion_mask[k].sum())
            tokens = out.completion_ids[k, :length]
            history[i].append(tokens)
            own[i].append(torch.ones(length, dtype=torch.long))
            logps[i].append(out.logprobs[k, :length] if out.logprobs is not None else torch.zeros(length))
            turns[i].append(out.texts[k])
            finish[i] = out.finish_reasons[k]

    take(list(range(n)), first)
    going, alone = list(range(n)), None
    for turn in range(1, env.settings.max_turns + 1):
        nxt = []
        for i in going:
            tool = env.step(samples[prompt_of[i]], turns[i][-1], len(tools[i])) if finish[i] == FINISH_STOP else None
            if tool is None:
                continue
            ids, visuals = turn_inputs(processor, tool)
            tool.tokens = int(ids.numel())
            tools[i].append(tool)
            history[i].append(ids)
            own[i].append(torch.zeros(ids.numel(), dtype=torch.long))
            logps[i].append(torch.zeros(ids.numel()))
            if visuals:
                clips[i].append(visuals)
            nxt.append(i)
        if (not nxt) if all_done is None else all_done(not nxt):
            break
        if branches is None:
            alone = alone or prompts_alone(model, prompt_inputs)  # the B prompts unpadded, split once
        if not nxt and branches is not None:  # every branch here has ended, another rank's go on (lockstep)
            engine.idle_turn()
            going = nxt
            continue
        if not nxt:  # the same, re-sending: a stand-in turn, for lockstep only
            stand_in = _continuations(model, alone, [0], prompt_of, history, clips, pad_id)
            engine.generate_groups(stand_in, 1, sampling, prompt_seeds=None if prompt_seeds is None else [0],
                                   videos=_videos(videos, [0], prompt_of, tools))
            prefilled += prefill_tokens(engine, stand_in)
            going = nxt
            continue
        seeds = None if prompt_seeds is None else \
            [int(prompt_seeds[prompt_of[i]]) * 1_000_003 + 1_009 * row_in_group[i] + turn for i in nxt]
        if branches is not None:  # behind each branch's kept K/V: its last token (never fed) and the tool's turn
            out = engine.continue_branches(branches, nxt, [torch.cat(history[i]) for i in nxt],
                                           [1 + history[i][-1].numel() for i in nxt], [clips[i] for i in nxt],
                                           sampling, row_seeds=seeds)
            prefilled += prefill_tokens(engine, None)
        else:
            inputs = _continuations(model, alone, nxt, prompt_of, history, clips, pad_id)
            out = engine.generate_groups(inputs, 1, sampling, prompt_seeds=seeds,
                                         videos=_videos(videos, nxt, prompt_of, tools))
            prefilled += prefill_tokens(engine, inputs)
        take(nxt, out)
        going = nxt
    # the clips' decoded frames are done with (their model inputs are in `clips`): released, the turns keep their counts
    tools = [[dataclasses.replace(t, clip=None) for t in row] for row in tools]
    rows = [torch.cat(h) for h in history]
    width = max(r.numel() for r in rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    own_mask, lp = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width)
    for i, r in enumerate(rows):
        ids[i, :r.numel()] = r
        own_mask[i, :r.numel()] = torch.cat(own[i])
        lp[i, :r.numel()] = torch.cat(logps[i])
    mask = (torch.arange(width)[None] < torch.tensor([r.numel() for r in rows])[:, None]).long()
    return Trajectories(ids, mask, own_mask, [merge_visuals(c) if c else {} for c in clips], list(sizes), turns,
                        tools, finish, lp if sampling.logprobs else None, prefilled)


def stand_in_turns(engine: RolloutEngine, inputs, sampling: SamplingParams, max_turns: int, all_done) -> int:
    """A rank with nothing to sample while the others sample trajectories (ZeRO-3 lockstep): `inputs` (a stand-in
    prompt) sampled once for the first turn and again for every later turn another rank takes, as
    `sample_trajectories` asks `all_done` once per turn; the results are discarded. Returns the prompt tokens it
    prefilled, counted as `sample_trajectories` counts its own (an idle turn behind kept K/V prefills none)."""
    engine.generate_groups(inputs, 1, sampling)
    prefilled = prefill_tokens(engine, inputs)
    keeps = getattr(engine, "keeps_branches", False)  # the others' later turns: behind kept K/V, or re-sent
    for _ in range(max_turns):
        if all_done(True):
            break
        if keeps:
            engine.idle_turn()
        else:
            engine.generate_groups(inputs, 1, sampling)
            prefilled += prefill_tokens(engine, inputs)
    return prefilled
