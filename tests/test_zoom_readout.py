"""mmpg.toy.zoom_readout: the zoom experiment's answer readout (the answer turn's loss by digit role, the starts
right, the last layer's attention on the clip's flash pair), checked against the training forward and the model's own
attention weights on a tiny Qwen3-VL over the experiment's task."""

from __future__ import annotations

import pytest
import torch

from mmpg.errors import UserError
from mmpg.toy.demo.zoom_learning import DATA_SEED, TASK
from mmpg.toy.zoom_readout import digit_roles, flash_rank, held_out_trajectories, read_one, readout, run_config


def test_digit_roles_follow_each_piece_first_character():
    pieces = ["<think>seen</think>", "<answer>", "7", "2", ".", "7", " to ", "7", "3", ".", "5", "</answer>",
              "<|im_end|>"]
    assert digit_roles(pieces) == ["text", "text", "start_lead", "start_units", "text", "start_tenths", "text",
                                   "end_lead", "end_units", "text", "end_tenths", "text", "text"]
    # a start below ten has no leading digit; a piece of several characters takes its first one's role
    assert digit_roles(["<answer>", "5", ".", "25", " to ", "10", ".0", "</answer>"]) == [
        "text", "start_units", "text", "start_tenths", "text", "end_lead", "text", "text"]
    for bad in (["no answer"], ["<answer>", "5 to 7", "</answer>"], ["<answer>", "a.5 to 7.0", "</answer>"],
                ["<answer>", "7.0 to 5.5"]):
        assert digit_roles(bad) is None


def test_flash_rank_is_the_best_flash_pair_in_each_head_order():
    weights = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.3, 0.2, 0.1], [0.0, 0.1, 0.0, 0.9]])
    ranks, share = flash_rank(weights, [False, False, True, True])
    assert ranks == [1.0, 2.0, 0.0]
    assert share == pytest.approx([0.4, 0.3, 0.9])


def test_flash_pairs_hold_the_drawn_flash():
    from mmpg.toy.zoom_task import clip_times, flash_pairs, rule_window, zoom_scenes

    for scene in zoom_scenes(12, DATA_SEED, TASK):
        start, end = rule_window(scene, TASK)
        times, shows = clip_times(scene, TASK, start, end), flash_pairs(scene, TASK, start, end)
        flash = scene.events[1]
        inside = [any(flash.start <= t < flash.end for t in times[k:k + 2]) for k in range(0, len(times), 2)]
        assert shows == inside and any(shows)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_dirs):
    """The experiment's task at 4 videos (1 test) and its zoom SFT stage's config over a tiny Qwen3-VL."""
    from mmpg.config.load import load_config
    from mmpg.toy.demo.zoom_learning import Paths, stage_overrides
    from mmpg.toy.zoom_task import write_zoom_dataset

    from train_utils import ROOT

    paths = Paths.under(tmp_path_factory.mktemp("readout"), 4, 0)
    write_zoom_dataset(paths.data, 4, seed=DATA_SEED, task=TASK)
    over = stage_overrides(paths, "zoom", "sft-answer", tiny_dirs["qwen3_vl"], 1, 0)
    return paths, load_config(ROOT / "configs" / "sft_cpu_demo.yaml", over), tiny_dirs["qwen3_vl"]


def test_readout_reads_the_training_forward_and_the_model_attention(experiment):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpg.data.prompts import build_prompt_inputs, get_template
    from mmpg.data.video import load_video
    from mmpg.grouping import grouped_logprobs
    from mmpg.sft.trajectories import trajectory_completion
    from mmpg.train.setup import video_spec, zoom_environment

    paths, cfg, ckpt = experiment
    items = held_out_trajectories(paths.data, TASK, DATA_SEED)
    assert len(items) == 1
    (trajectory, shows), = items
    assert tuple(trajectory.weights) == (0, 1) and sum(shows) >= 1  # the call out of the loss; the clip shows the flash
    got = readout(ckpt, cfg, items, attention=1)
    heads = AutoModelForImageTextToText.from_pretrained(ckpt).config.text_config.num_attention_heads
    assert got.count == got.attention_count == 1 and len(got.flash_rank) == len(got.flash_weight) == heads
    assert all(0 <= r <= len(shows) - 1 for r in got.flash_rank) and all(0 <= w <= 1 for w in got.flash_weight)
    assert got.pairs == len(shows) and {"start_units", "start_tenths", "end_units", "text"} <= set(got.nats)

    # the same inputs through the training forward (grouped, the trajectory tree) and the model's own attention
    processor = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    spec = video_spec(cfg, "qwen3_vl")
    sample = trajectory.sample
    prompt = build_prompt_inputs(processor, [sample], [load_video(sample.video, spec, sample.clip_start,
                                                                  sample.clip_end)], get_template("zoom"))
    stop = model.generation_config.eos_token_id
    stop = stop if isinstance(stop, int) else stop[0]
    ids, own, clip = trajectory_completion(processor, trajectory, zoom_environment(cfg, "qwen3_vl"), stop)
    with torch.no_grad():
        trained = grouped_logprobs(model, prompt, ids[None], torch.ones_like(ids)[None], [1],
                                   completion_visuals=[clip])[0]
    text = processor.tokenizer.decode(ids[own.bool()])
    answer = text[text.index("<answer>") + len("<answer>"):text.index(" to ")]
    assert f"<answer>{answer} to " in trajectory.turns[-1]
    # the start's units digit: the own token just before the start's decimal point
    at = own.nonzero()[:, 0]
    pieces = [processor.tokenizer.decode([int(t)]) for t in ids[at]]
    offsets = [sum(len(p) for p in pieces[:j]) for j in range(len(pieces))]
    units_char = text.index("<answer>") + len("<answer>") + answer.index(".") - 1
    units = int(at[offsets.index(units_char)])
    assert got.nats["start_units"] == pytest.approx(-float(trained[units]), rel=1e-5)

    width = prompt["input_ids"].shape[1]
    row = {"input_ids": torch.cat([prompt["input_ids"][0], ids])[None],
           "attention_mask": torch.ones(1, width + ids.numel(), dtype=torch.long),
           "mm_token_type_ids": torch.cat([prompt["mm_token_type_ids"][0],
                                           torch.where(ids == processor.tokenizer.convert_tokens_to_ids(
                                               "<|video_pad|>"), 2, 0)])[None],
           "pixel_values_videos": torch.cat([prompt["pixel_values_videos"], clip["pixel_values_videos"]]),
           "video_grid_thw": torch.cat([prompt["video_grid_thw"], clip["video_grid_thw"]])}
    with torch.no_grad():
        out = model(**row, output_attentions=True, use_cache=False)
    last = out.attentions[-1][0, :, width + units - 1]  # [heads, L] at the position predicting the units digit
    clip_at = width + (ids == processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")).nonzero()[:, 0]
    per_pair = last[:, clip_at].reshape(heads, len(shows), -1).sum(-1)
    one = read_one(model, processor, prompt, ids, own, clip, shows)
    torch.testing.assert_close(one["clip_weights"], per_pair, rtol=1e-5, atol=1e-7)
    expect_ranks, expect_share = flash_rank(per_pair, shows)
    assert got.flash_rank == expect_ranks and got.flash_weight == pytest.approx(expect_share, rel=1e-5)
    logits = out.logits[0, width - 1:-1]  # logits[t] predicts completion token t
    start = [int(at[j]) for j, r in enumerate(one["roles"]) if r.startswith("start_")]
    assert one["start_right"] == bool((logits[start].argmax(-1) == ids[start]).all())


def test_the_readout_refuses_a_checkpoint_of_another_template(experiment, tiny_dirs):
    from mmpg.config.load import load_config
    from mmpg.toy.demo.zoom_learning import stage_overrides

    from train_utils import ROOT

    paths, _, ckpt = experiment  # the clip stage's run trains one look (time_r1), not zoom trajectories
    clips = load_config(ROOT / "configs" / "sft_cpu_demo.yaml", stage_overrides(paths, "zoom", "sft-clips", ckpt, 1, 0))
    with pytest.raises(UserError, match="data.template 'time_r1'; the readout teacher-forces zoom trajectories"):
        readout(ckpt, clips, held_out_trajectories(paths.data, TASK, DATA_SEED))


def test_the_readout_names_a_run_without_its_config_and_another_task(tmp_path, zoom_data):
    with pytest.raises(UserError, match="no config.yaml in its run folder"):
        run_config(tmp_path / "run" / "checkpoints" / "step_00000001")
    # the multi-turn tests' zoom videos are 24 s long: not the experiment's task, whose scenes the readout redraws
    with pytest.raises(UserError, match="is not a video of ZoomTask"):
        held_out_trajectories(zoom_data, TASK, DATA_SEED)
