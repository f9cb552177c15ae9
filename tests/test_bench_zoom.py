"""`python -m mmpg.bench.zoom` (the trajectory tree's update against the per-branch forward): the program runs and
prints its table on tiny shapes, the case it builds is what multi-turn rollouts write (each branch's clips, the
model's-token mask), and its FLOPs ceiling is the hand count of the two layouts."""

from __future__ import annotations

import json

import torch

from mmpg.bench import zoom
from mmpg.models.geometry import Geometry


def test_the_program_prints_its_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert zoom.main(["--G", "4", "--P", "80", "--C", "24", "--S", "6", "--zooms", "0", "2", "--rounds", "1",
                      "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| G | zooms | P |" in text and "| 4 | 0-2 |" in text
    (row,) = json.loads(out.read_text())
    assert row["ceiling"] > 1 and set(row["measured"]) == {"per-branch", "tree"}
    assert all(m["seconds"] > 0 for m in row["measured"].values())


def test_the_case_is_a_trajectory_tree():
    from mmpg.bench.model import build_model

    case = {"family": "qwen2_5_vl", "spec": zoom.PRESETS["cpu"]["spec"] | {"num_layers": 1}, "dtype": "float32"}
    model, ids = build_model(case, torch.device("cpu"))
    prompt, comp, mask, own, visuals, shape = zoom.build_case(model, ids, 80, 24, 6, 3, [0, 1, 2],
                                                              torch.device("cpu"))
    pads = (comp == ids["video"]).sum(dim=1).tolist()
    assert pads[0] == 0 and pads[2] == 2 * pads[1] > 0  # 0, 1 and 2 clips of the same size
    assert [int(v["video_grid_thw"].shape[0]) if v else 0 for v in visuals] == [0, 1, 2]
    assert own.sum(dim=1).tolist() == [6, 12, 18]  # the model's turns only
    assert shape["lengths"] == mask.sum(dim=1).tolist()
    from mmpg.grouping import grouped_logprobs, repeated_logprobs

    with torch.no_grad():
        tree = grouped_logprobs(model, prompt, comp, mask, [3], completion_visuals=visuals)
        branch = repeated_logprobs(model, prompt, comp, mask, [3], completion_visuals=visuals)
    assert float((tree - branch).abs().masked_fill(mask == 0, 0).max()) < 1e-5


def test_the_ceiling_counts_both_layouts():
    dims = Geometry(name="t", hidden=8, layers=2, heads=2, kv_heads=1, intermediate=16, vocab=10, head_dim=4)
    shape = {"P": 100, "lengths": [10, 30], "video_patches": 0, "frame_patches": 0, "clip_patches": [],
             "clip_frame_patches": 0}
    lin, pair = 2 * (8 * 2 * 4 + 2 * 8 * 1 * 4 + 2 * 4 * 8 + 3 * 8 * 16), 4 * 2 * 4
    head = 2 * 8 * 10 * 40
    repeated = 2 * (lin * 2 * 130 + pair * 2 * 130 ** 2 / 2) + head  # two rows padded to 130
    tree = 2 * (lin * 140 + pair * (100 ** 2 / 2 + 10 * 100 + 10 ** 2 / 2 + 30 * 100 + 30 ** 2 / 2)) + head
    assert abs(zoom.ceiling(dims, shape) - repeated / tree) < 1e-12


def test_the_rollout_program_prints_its_table(capsys):
    """`python -m mmpg.bench.zoom_rollout` on tiny shapes: both paths sample the same tokens (the program checks),
    the kept path prefills and encodes less (the overview once)."""
    from mmpg.bench import zoom_rollout

    assert zoom_rollout.main(["--prompts", "1", "--G", "2", "--pixels", str(56 * 56), "--overview-fps", "1",
                              "--zoom-frames", "4", "--new-tokens", "8", "--stop-every", "4", "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    assert "same tokens: yes" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith(("kept", "re-sent"))}
    assert int(rows["kept"][1]) < int(rows["re-sent"][1]) and int(rows["kept"][3]) < int(rows["re-sent"][3])
