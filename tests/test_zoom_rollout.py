"""Multi-turn rollouts with the zoom tool (`mmpg.rollout.multiturn.sample_trajectories`) on the HF engine.

- Greedy trajectories equal a per-branch reference loop token for token: each branch alone, its whole conversation
  (prompt, turns, tool turns with their clips) re-sent to the model's own forward for every token, no cache.
- The engine's logprobs of the model's own tokens equal the grouped forward's trajectory tree over the same
  completions and clips (`completion_visuals`, float32, 1e-5), so rollout and training score the same thing.
- The HF engine keeps each branch's K/V between turns (`keep_turns`, the default): the same tokens as re-sending
  every turn's conversation (greedy and seeded sampling, shared videos, prompts of one video apart in the batch),
  and the overview is prefilled once for the whole trajectory tree.
- Tool turns are context: `own_mask` is 0 on them; each zoom's clip is the row's; a branch that answers (no call),
  or is cut at max_new_tokens, ends.

The tiny models are random, so the tool's side is scripted where the test needs calls (`Scripted`: every stopped
turn calls the tool on a window chosen by the row); the stop tokens are half the vocabulary so that turns end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batches import video_prompts, write_mp4

from mmpg.data.samples import GroundingSample
from mmpg.data.video import VideoSpec
from mmpg.grouping import grouped_logprobs
from mmpg.grouping.inputs import (
    merge_visuals, mm_token_type_ids, pad_token_id, placeholder_token_ids, prompts_alone, select_prompts,
)
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.multiturn import sample_trajectories
from mmpg.rollout.zoom import ZoomCall, ZoomEnvironment, ZoomSettings, turn_inputs

LOGP_ATOL = 1e-5


class Scripted(ZoomEnvironment):
    """Every stopped turn calls zoom (until max_turns): windows that differ by turn and by the turn's text, and one
    window past the video for an error turn."""

    def step(self, sample, turn, tool_turns):
        if tool_turns >= self.settings.max_turns:
            return None
        start = float(2 * tool_turns + sum(map(ord, turn)) % 3)
        if sample.sample_id.endswith("#0") and tool_turns == 1:
            start = 30.0  # outside the 20-second video: an error turn
        text = f'<tool_call>\n{{"name": "zoom", "arguments": {{"start": {start}, "end": {start + 2}}}}}\n</tool_call>'
        return super().step(sample, text, tool_turns)


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = tmp_path_factory.mktemp("zoom_rollout") / "v.mp4"
    return str(write_mp4(path, [np.full((56, 84, 3), (k * 7) % 256, dtype=np.uint8) for k in range(100)], fps=5))


def _env(family, cls=Scripted):
    f2 = VideoSpec.for_family(family).factor ** 2
    return cls(ZoomSettings(fps=2.0, max_frames=4, max_turns=2),
               VideoSpec.for_family(family, min_pixels=4 * f2, max_pixels=6 * f2))


def _reference(model, processor, prompt: dict, env, sample, sampling: SamplingParams) -> tuple[torch.Tensor, list]:
    """One branch alone: every token by a forward of the whole conversation so far (no cache), greedy; the tool's
    turns as the loop appends them. -> (its completion ids, its clips)."""
    banned = torch.tensor(placeholder_token_ids(model))
    stop = set(sampling.stop_token_ids)
    history, clips, tools = [], [], 0
    visuals = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    while True:
        turn = []
        for _ in range(sampling.max_new_tokens):
            ids = torch.cat([prompt["input_ids"][0], *history, torch.tensor(turn, dtype=torch.long)])[None]
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "mm_token_type_ids": mm_token_type_ids(model, {"input_ids": ids}),
                      **(merge_visuals([visuals, *clips]) if clips else visuals)}
            with torch.no_grad():
                logits = model(**inputs, use_cache=False).logits[0, -1]
            tok = int(logits.index_fill(0, banned, float("-inf")).argmax())
            turn.append(tok)
            if tok in stop:
                break
        history.append(torch.tensor(turn, dtype=torch.long))
        text = processor.batch_decode([turn], skip_special_tokens=True)[0]
        tool = env.step(sample, text, tools) if turn[-1] in stop else None
        if tool is None:
            return torch.cat(history), clips
        ids, vis = turn_inputs(processor, tool)
        history.append(ids)
        tools += 1
        if vis:
            clips.append(vis)


def _spy(monkeypatch) -> list[int]:
    """How many branches each later turn of the K/V-keeping path fed (`HFEngine.continue_branches`)."""
    calls, real = [], HFEngine.continue_branches

    def spy(self, branches, rows, *args, **kwargs):
        calls.append(len(rows))
        return real(self, branches, rows, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "continue_branches", spy)
    return calls


@pytest.mark.parametrize("keep", [True, False], ids=["kv-kept", "re-sent"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_greedy_trajectories_equal_each_branch_alone_and_score_as_trained(family, keep, video, load_tiny,
                                                                          monkeypatch):
    model, processor = load_tiny(family)
    vocab = model.config.text_config.vocab_size
    sampling = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=tuple(range(0, vocab, 2)))
    inputs = video_prompts(processor, [0, 1, None, 3], "left")  # greedy: a prompt's rows are alike; prompts differ
    samples = [GroundingSample(f"v#{b}", video, 20.0, "q", (5.0, 6.0)) for b in range(4)]
    env = _env(family)
    sizes = [2, 1, 1, 1]
    calls = _spy(monkeypatch)
    out = sample_trajectories(HFEngine(model, processor, keep_turns=keep), model, processor, inputs, samples, sizes,
                              env, sampling)
    assert (len(calls) == env.settings.max_turns) if keep else not calls, calls
    assert sum(out.zooms) >= 3 and any(t.error for row in out.tools for t in row), \
        (out.zooms, [[t.error for t in row] for row in out.tools])
    # token for token: each branch generated alone with its whole conversation re-sent
    alone = prompts_alone(model, inputs)
    for i, b in enumerate([0, 0, 1, 2, 3]):
        ref, clips = _reference(model, processor, alone[b], env, samples[b], sampling)
        n = int(out.completion_mask[i].sum())
        assert out.completion_ids[i, :n].tolist() == ref.tolist(), f"row {i}"
        assert len(clips) == out.zooms[i]
    # the tool turns are context, each clip the row's own
    for i, row in enumerate(out.tools):
        tool_tokens = int((out.completion_mask[i] - out.own_mask[i]).sum())
        assert tool_tokens == sum(t.tokens for t in row) and all(t.clip is None for t in row)  # frames released
        assert bool((out.own_mask[i] <= out.completion_mask[i]).all()) and len(out.turns[i]) == len(row) + 1
        grid = out.completion_visuals[i].get("video_grid_thw")
        assert (0 if grid is None else grid.shape[0]) == out.zooms[i]
    # the rollout's logprobs of the model's tokens = the grouped forward's trajectory tree over the same rows
    with torch.no_grad():
        tree = grouped_logprobs(model, inputs, out.completion_ids, out.completion_mask, sizes,
                                completion_visuals=out.completion_visuals)
    diff = ((tree - out.logprobs).abs() * out.own_mask).max()
    assert float(diff) <= LOGP_ATOL, float(diff)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_kept_kv_samples_what_resending_samples(family, video, load_tiny, monkeypatch):
    """Seeded sampling at temperature 1 with a video asked two questions whose prompts lie apart in the batch (the
    engine samples them side by side, their shared part prefilled once): the K/V-keeping path gives the re-sent
    path's tokens, turn by turn, and logprobs within 1e-5; the vision tower sees the overviews once."""
    model, processor = load_tiny(family)
    vocab = model.config.text_config.vocab_size
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=tuple(range(0, vocab, 2)))
    inputs = video_prompts(processor, [0, 1, 0], "left")
    samples = [GroundingSample(f"v#{b}", video, 20.0, "q", (5.0, 6.0)) for b in range(3)]
    env, sizes, seeds = _env(family), [3, 2, 2], [5, 6, 7]
    calls = _spy(monkeypatch)
    towers = []
    hook = model.model.visual.register_forward_hook(
        lambda m, a, kw, o: towers.append(kw["grid_thw"].tolist()), with_kwargs=True)
    kept = sample_trajectories(HFEngine(model, processor), model, processor, inputs, samples, sizes, env, sampling,
                               prompt_seeds=seeds)
    hook.remove()
    sent = sample_trajectories(HFEngine(model, processor, keep_turns=False), model, processor, inputs, samples, sizes,
                               env, sampling, prompt_seeds=seeds)
    assert calls and sum(kept.zooms) >= 3, (calls, kept.zooms)
    assert torch.equal(kept.completion_ids, sent.completion_ids) and torch.equal(kept.own_mask, sent.own_mask)
    assert kept.turns == sent.turns
    assert float(((kept.logprobs - sent.logprobs).abs() * kept.own_mask).max()) <= LOGP_ATOL
    # the first forward through the vision tower holds the two videos, later ones only clips (4 frames: 2 patches)
    assert len(towers[0]) == 2 and all(t == 2 for grids in towers[1:] for t, _, _ in grids), towers
    with torch.no_grad():
        tree = grouped_logprobs(model, inputs, kept.completion_ids, kept.completion_mask, sizes,
                                completion_visuals=kept.completion_visuals)
    assert float(((tree - kept.logprobs).abs() * kept.own_mask).max()) <= LOGP_ATOL


def test_a_branch_that_answers_or_is_cut_ends(video, load_tiny):
    """With the real tool and a model that never calls it, one turn: the trajectories are the engine's rollout."""
    model, processor = load_tiny("qwen2_5_vl")
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    inputs = video_prompts(processor, [0], "left")
    samples = [GroundingSample("v#0", video, 20.0, "q", (5.0, 6.0))]
    out = sample_trajectories(HFEngine(model, processor), model, processor, inputs, samples, 2,
                              _env("qwen2_5_vl", ZoomEnvironment), sampling)
    plain = HFEngine(model, processor).generate_groups(inputs, 2, sampling)
    assert out.zooms == [0, 0] and out.tools == [[], []] and out.completion_visuals == [{}, {}]
    assert torch.equal(out.completion_ids, plain.completion_ids) and torch.equal(out.own_mask, plain.completion_mask)
    assert out.turns == [[t] for t in plain.texts]


def test_seeded_branches_do_not_depend_on_each_other(video, load_tiny):
    """prompt_seeds: a branch's every turn is seeded by its prompt, its row and the turn, so a prompt sampled alone
    gives the same trajectories as in a batch."""
    model, processor = load_tiny("qwen3_vl")
    vocab = model.config.text_config.vocab_size
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=tuple(range(0, vocab, 2)))
    inputs = video_prompts(processor, [0, 1], "left")
    samples = [GroundingSample(f"v#{b}", video, 20.0, "q", (5.0, 6.0)) for b in range(2)]
    env = _env("qwen3_vl")
    both = sample_trajectories(HFEngine(model, processor), model, processor, inputs, samples, 2, env, sampling,
                               prompt_seeds=[11, 12])
    second = select_prompts(model, inputs, [1], pad_token_id(model))
    alone = sample_trajectories(HFEngine(model, processor), model, processor, second, samples[1:], 2, env, sampling,
                                prompt_seeds=[12])
    n = alone.completion_ids.shape[1]
    assert torch.equal(both.completion_ids[2:, :n], alone.completion_ids)
    assert sum(both.zooms) >= 1 and both.completion_ids[0].tolist() != both.completion_ids[1].tolist()
    with torch.no_grad():  # sampled at temperature 1: the logprobs are the policy's, as the tree scores them
        tree = grouped_logprobs(model, inputs, both.completion_ids, both.completion_mask, [2, 2],
                                completion_visuals=both.completion_visuals)
    assert float(((tree - both.logprobs).abs() * both.own_mask).max()) <= LOGP_ATOL


def test_zoom_call_text_is_what_the_tool_parses():
    from mmpg.rollout.zoom import parse_call

    text = '<tool_call>\n{"name": "zoom", "arguments": {"start": 2.0, "end": 4.0}}\n</tool_call>'
    assert parse_call(text) == ZoomCall(2.0, 4.0)


@pytest.mark.parametrize("keeps", [False, True])
def test_a_stand_in_rank_counts_the_prefills_it_runs(keeps):
    """`stand_in_turns` (a rank with nothing to sample in lockstep) joins every turn the others take and returns the
    prompt tokens it prefilled, as `sample_trajectories` counts its own: a re-sent stand-in prompt each turn, none
    for an idle turn behind kept K/V."""
    from mmpg.rollout.multiturn import stand_in_turns

    class Engine:
        keeps_branches = keeps
        last_stats = {"prefix_tokens": 7}

        def __init__(self):
            self.calls = []

        def generate_groups(self, inputs, n, sampling):
            self.calls.append("prefill")

        def idle_turn(self):
            self.calls.append("idle")

    votes = iter([False, False, True])  # the others take two more turns, then all are done
    engine = Engine()
    got = stand_in_turns(engine, {"input_ids": None}, SamplingParams(max_new_tokens=4), 3, lambda done: next(votes))
    assert engine.calls == ["prefill"] + (["idle"] * 2 if keeps else ["prefill"] * 2)
    assert got == (7 if keeps else 21)
