"""What the vLLM engine sends for a prompt's videos (no server needed): each video back in the chat template's form
`<vs> <pad> <ve>`, which vLLM expands again from the frames."""

from __future__ import annotations

from mmpg.rollout.vllm import _collapse_videos

VS, VE, PAD = 1, 2, 9  # vision start, vision end, video token
T1, T2 = 50, 51  # timestamp text tokens ("<0.3 seconds>", "<1.3 seconds>")


def test_qwen2_5_vl_run_becomes_one_token():
    assert _collapse_videos([7, VS, PAD, PAD, PAD, VE, 8], PAD, (VS, VE)) == [7, VS, PAD, VE, 8]


def test_qwen3_vl_frames_and_timestamps_go_inside_the_outer_pair():
    ids = [7, VS, T1, VS, PAD, PAD, VE, T2, VS, PAD, PAD, VE, VE, 8, VS, PAD, VE]  # two videos
    assert _collapse_videos(ids, PAD, (VS, VE)) == [7, VS, PAD, VE, 8, VS, PAD, VE]


def test_text_and_unclosed_pairs_are_kept():
    assert _collapse_videos([7, VS, 8, VE, 9], PAD, (VS, VE)) == [7, VS, 8, VE, 9]  # a pair without video
    assert _collapse_videos([7, VS, PAD, PAD], PAD, (VS, VE)) == [7, VS, PAD]  # never closed: runs collapsed only
    assert _collapse_videos([7, 8], None, None) == [7, 8]  # a text model
