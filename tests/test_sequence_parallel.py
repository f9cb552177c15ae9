"""Sequence parallelism composed with the grouped forward (`mmpg.grouping.sequence`, `mmpg.grouping.ulysses`).

2 gloo processes (`tests/sp_worker.py` under torchrun) spread each packed row over sp = 2 ranks, on tiny float32
Qwen2.5-VL and Qwen3-VL: logprobs within 1e-5 of the one-process grouped forward and of `repeated_logprobs`, every
parameter's gradient (vision tower included; the mean over the 2 ranks) within 1e-4 relative of the one-process
gradient. Cases: several prompts of different videos (and one without) with unequal groups, left and right padding,
odd row lengths (padding to a multiple of sp), a shared video, 1 kv head (repeated) and 2 (split), the cut
between the ranks inside a video, inside a query's tail and inside a response, and a trajectory tree (zoom clips
inside the responses). Each rank's vision tower encodes only
its share of the frames.
"""

from __future__ import annotations

import json

import pytest

from mmpg.grouping.sequence import _item_order, frame_ranges
from mmpg.grouping.ulysses import check_heads, kv_repeats
from train_utils import run_forked

LOGP_ATOL = 1e-5
GRAD_RTOL = 1e-4
FEATURE_ATOL = 1e-5  # the vision tower on a rank's temporal slices against the whole video, float32


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "results.json"
    proc = run_forked("sp_worker:main", [str(out)], procs=2)  # two ranks, as torchrun starts them
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


CASES = ["several_left", "several_right", "kv1_replicated", "shared_cut_in_tail", "cut_in_video", "cut_in_response_odd"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sp2_trajectory_tree_equals_one_process(sp_results, family):
    """Branches holding zoom clips (tests/test_trajectory_tree.py) with the row over 2 ranks: the prompts' videos
    whole on each rank or each rank's part, the clips whole and each rank encoding its share of their frames."""
    r = sp_results[f"{family}/trajectory_tree"]
    assert r["clips"] == 6 and r["vision_grads"], r
    assert r["logp_vs_repeated_one"] <= LOGP_ATOL, r
    for held in ("whole", "part"):
        assert r[f"{held}_logp"] <= LOGP_ATOL and r[f"{held}_grad_rel"] <= GRAD_RTOL and r[f"{held}_same_grads"], r
    if "rep_part_logp" in r:  # transformers >= 5.18: the repeated reference from parts, clips as features too
        assert r["rep_part_logp"] <= LOGP_ATOL, r


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("case", CASES)
def test_sp2_equals_one_process(sp_results, family, case):
    r = sp_results[f"{family}/{case}"]
    assert r["logp_vs_grouped"] <= LOGP_ATOL, r
    assert r["logp_vs_repeated"] <= LOGP_ATOL, r
    assert r["zero_outside_mask"], r
    assert r["grad_rel"] <= GRAD_RTOL, r
    assert r["vision_grads"], "the vision tower's gradients must be compared too"
    # each rank holding only its part of the pixels (decoded per rank): the same logprobs and gradients
    assert r["part_logp"] <= LOGP_ATOL and r["part_grad_rel"] <= GRAD_RTOL and r["part_same_grads"], r
    # the repeated reference from parts (the group encodes the whole videos, passed as features), and those features
    if r["rep_part_logp"] is None:  # a transformers whose forward takes no features (< 5.18): one clear refusal
        assert "mm_encoder_outputs, transformers >= 5.18" in (r["rep_part_refused"] or ""), r
    else:
        assert r["rep_part_logp"] <= LOGP_ATOL and r["rep_part_grad_rel"] <= GRAD_RTOL and r["rep_part_vision_grads"], r
    assert r["features_max"] <= FEATURE_ATOL and r["features_rows"][0] == r["features_rows"][1], r
    # each rank encodes its share of the frames, not the whole video (a single-group video: one rank, plus a
    # stand-in group on the other for lockstep)
    assert sum(r["vision_rows"]) <= r["pixel_rows"] + min(r["vision_rows"]), r
    expected_cut = {"shared_cut_in_tail": "tail", "cut_in_video": "video", "cut_in_response_odd": "response"}
    if case in expected_cut:
        assert r["cut"] == expected_cut[case], r


def test_cases_cover_odd_rows_and_split_frames(sp_results):
    assert any(r["row"] % 2 for r in sp_results.values())  # padding to a multiple of sp
    assert any(min(r["vision_rows"]) > 0 and max(r["vision_rows"]) < r["pixel_rows"] for r in sp_results.values())


def test_heads_that_cannot_be_split_are_named():
    assert check_heads(28, 4, 2) is None and check_heads(28, 4, 4) is None
    assert kv_repeats(28, 4, 8) == 2 and kv_repeats(4, 1, 2) == 2 and kv_repeats(4, 2, 2) == 1
    assert "28 attention heads" in check_heads(28, 4, 8)
    assert "attention heads" in check_heads(12, 2, 8)  # 8 does not divide 12 query heads
    assert check_heads(6, 2, 3) is None  # lcm(2, 3) = 6 divides 6 query heads: each kv head repeated 3 times
    assert kv_repeats(6, 2, 3) == 3 and kv_repeats(12, 3, 4) == 4


def test_frame_ranges_and_item_order():
    assert frame_ranges(5, 2) == [(0, 2), (2, 5)]
    assert frame_ranges(1, 2) == [(0, 0), (0, 1)]
    # two items of 3 and 2 tokens per rank: rank-major [r0 i0 (3), r0 i1 (2), r1 i0 (3), r1 i1 (2)] -> item order
    assert _item_order([[3, 2], [3, 2]]).tolist() == [0, 1, 2, 5, 6, 7, 3, 4, 8, 9]
