"""`mmpg plan --decode` / `--decode-fps N`: whether the data workers decode videos as fast as a step, by hand-computed
figures from a fixed figure, the typical video from a readable data.train, the frame counts against qwen-vl-utils'
own, the probe on tiny generated clips within its time budget, and the JSON keys."""

from __future__ import annotations

import datetime
import json
import math

import pytest

from mmpg.config import load_config
from mmpg.plan.decode import KEYFRAME_FRAMES, decoded_frames, per_pixels, sampled_frames, typical_video
from mmpg.plan.decode_probe import PROBE_BUDGET_S

LONG = "configs/grounding_qwen25vl_7b_long.yaml"


def _plan(*args, capsys):
    from mmpg.cli import main

    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _decode_json(*args, capsys) -> dict:
    rc, out, err = _plan("--config", LONG, "--gpus", "8", "--gpu", "h100", "--json", *args, capsys=capsys)
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture
def whole_videos(monkeypatch):
    """A transformers whose forward takes no precomputed features: GRPO's sp ranks decode their videos whole."""
    from mmpg.plan import decode

    monkeypatch.setattr(decode, "samples_from_features", lambda: False)


def test_a_fixed_figure_scales_to_the_step_by_hand(capsys, whole_videos):
    p = _decode_json("--decode-fps", "600", "--video-minutes", "10", capsys=capsys)
    d, step = p["decode"], p["step_seconds"]["total"]
    assert d["source"] == "--decode-fps" and d["probe"] is None and d["video_from"] == "yours (--video-minutes)"
    # 10 min of 30 fps = 18,000 frames at 600 a second: 30 s a video; 1 fps under the 768 cap: 600 sampled
    assert d["sampled_frames"] == 600 and d["seconds_per_video"] == pytest.approx(30.0)
    # 16 prompts over 2 data-parallel groups (8 GPUs / sp 4): 8 a rank, 4 queries a video -> 2 videos a step
    assert (d["prompts_per_rank"], d["queries_per_video"], d["videos_per_step"]) == (8, 4, 2)
    assert d["core_seconds_per_step"] == pytest.approx(60.0) and d["workers"] == 4
    assert d["seconds_per_step"] == pytest.approx(15.0) and step == pytest.approx(58.96, abs=0.01)
    assert d["keeps_up"] is True and d["workers_needed"] == 2 and d["cores_per_node"] == 16
    assert d["video_fps_per_core"] == pytest.approx(600.0)


def test_sft_under_sequence_parallelism_decodes_a_ranks_part(capsys):
    # the long config planned as an SFT step: each of the 4 ranks of a group decodes its quarter of each video
    p = _decode_json("--job", "sft", "--decode-fps", "600", "--video-minutes", "10", capsys=capsys)
    d = p["decode"]
    assert (p["job"], d["sp"], d["rank_share"]) == ("sft", 4, 0.25)
    assert d["core_seconds_per_step"] == pytest.approx(d["videos_per_step"] * 30.0 / 4)
    rc, out, _ = _plan("--config", LONG, "--job", "sft", "--gpus", "8", "--gpu", "h100", "--decode-fps", "600",
                       "--video-minutes", "10", capsys=capsys)
    assert rc == 0 and "each rank of its sequence-parallel group decoding its 1/4" in out, out


def test_grpo_ranks_decode_their_part_where_sampling_takes_features(capsys, monkeypatch):
    from mmpg.plan import decode

    monkeypatch.setattr(decode, "samples_from_features", lambda: True)
    d = _decode_json("--decode-fps", "600", "--video-minutes", "10", capsys=capsys)["decode"]
    assert d["rank_share"] == 0.25 and d["core_seconds_per_step"] == pytest.approx(15.0)  # 60 s of one rank / 4


def test_a_slow_figure_does_not_keep_up_and_says_what_it_takes(capsys, whole_videos):
    rc, out, _ = _plan("--config", LONG, "--gpus", "8", "--gpu", "h100", "--decode-fps", "100", "--video-minutes",
                       "10", capsys=capsys)
    assert rc == 0
    # 180 s a video, 2 videos: 360 s of one core a step; 4 workers: 90 s against 58.96; ceil(360 / 58.96) = 7
    assert "data.num_workers 4: 90.0 s of decoding a step against the 58.96 s step: DOES NOT KEEP UP" in out
    assert "7 workers a rank keep up: 56 cores a node of 8 GPUs" in out
    assert "180.0 s each on one core: 10.0 min of 1280x720 at 30 fps, 600 frames sampled" in out
    assert "each of the 4 ranks of its sequence-parallel group decoding them whole" in out
    assert "figure: 100 video frames/s a core, yours (--decode-fps)" in out
    assert "data.frame_cache=DIR, filled by `mmpg prepare-videos`" in out


def test_no_workers_the_cache_and_the_footage(capsys, whole_videos):
    p = _decode_json("--decode-fps", "300", "--video-minutes", "2", "--footage", "1920x1080@25",
                     "data.num_workers=0", "data.frame_cache=cache", capsys=capsys)
    d = p["decode"]
    # 2 min of 25 fps = 3,000 frames at 300 a second: 10 s; 120 sampled at 1 fps
    assert d["footage"] == {"width": 1920, "height": 1080, "fps": 25.0} and d["sampled_frames"] == 120
    assert d["seconds_per_video"] == pytest.approx(10.0) and d["keeps_up"] is False and d["frame_cache"] is True
    rc, out, _ = _plan("--config", LONG, "--gpus", "8", "--gpu", "h100", "--decode-fps", "300", "--video-minutes",
                       "2", "--footage", "1920x1080@25", "data.num_workers=0", "data.frame_cache=cache", capsys=capsys)
    assert "data.num_workers 0: 20.0 s of decoding in the training process each step" in out
    assert "data.frame_cache is set: the first epoch decodes as above" in out


def test_the_plan_is_unchanged_without_the_flags(capsys):
    p = _decode_json(capsys=capsys)
    assert p["decode"] is None
    rc, out, _ = _plan("--config", LONG, "--gpus", "8", "--gpu", "h100", capsys=capsys)
    assert "video decoding: not estimated (--decode probes" in out


@pytest.mark.parametrize("args, words", [
    (["--video-minutes", "10"], "give --decode (probe this machine) or --decode-fps N"),
    (["--decode-fps", "0"], "--decode-fps 0.0: give frames of video one core loads per second"),
    (["--decode-fps", "500", "--footage", "720p"], "--footage 720p: give the source video's frame size and rate"),
    (["--decode-fps", "500", "--video-minutes", "-1"], "--video-minutes -1.0"),
])
def test_bad_decode_flags_are_one_line_exit_2(args, words, capsys):
    rc, out, err = _plan("--config", LONG, "--gpus", "8", *args, capsys=capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("seconds, fps, min_frames, max_frames", [
    (600, 1.0, 4, 768), (3600, 1.0, 4, 768), (30, 2.0, 4, 64), (1.0, 2.0, 4, 64), (95.5, 2.0, 5, 63), (7, 0.5, 4, 9)])
def test_sampled_frames_are_qwen_vl_utils(seconds, fps, min_frames, max_frames):
    from qwen_vl_utils.vision_process import smart_nframes

    total = int(seconds * 30)
    ele = {"fps": fps, "min_frames": min_frames, "max_frames": max_frames}
    assert sampled_frames(total, 30.0, fps, min_frames, max_frames) == smart_nframes(ele, total, 30.0)


def test_decoded_frames_by_hand():
    k = KEYFRAME_FRAMES
    # 10 min at 1 fps: a sample every 30 frames, all decoded, plus the check's middle and last keyframe runs
    assert decoded_frames(18000, 600) == 18000 + k
    # 10 min, 64 samples: 281 frames apart, past a keyframe interval: half of one a sample on average
    assert decoded_frames(18000, 64) == 64 * k / 2 + k
    assert decoded_frames(60, 4) == 60 + 60  # a clip shorter than the interval: the check decodes it once more
    rows = [{"width": 640, "height": 360, "decode_s": 1.0}, {"width": 1280, "height": 720, "decode_s": 3.0}]
    assert per_pixels(rows, "decode_s", 1280 * 720) == 3.0
    # 1080p: 9 x 360p's pixels, 720p 4 x: 1 + (9 - 1) x (3 - 1) / (4 - 1)
    assert per_pixels(rows, "decode_s", 1920 * 1080) == pytest.approx(1 + 8 * 2 / 3)
    assert per_pixels(rows[:1], "decode_s", 1280 * 720) == 4.0


def test_the_typical_video_is_data_train_s_mean_window(tmp_path):
    lines = [{"video": "a.mp4", "duration": 60, "query": f"q{i}", "span": [1, 2]} for i in range(3)]
    lines += [{"video": "b.mp4", "duration": 120, "query": "q", "span": [1, 2]},
              {"video": "c.mp4", "duration": 100, "clip": [10, 40], "query": "q", "span": [1, 2]}]
    ann = tmp_path / "train.jsonl"
    ann.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = load_config(LONG, [f"data.train={ann}", f"data.videos={tmp_path}", "data.queries_per_video=2"])
    foot = typical_video(cfg, None, None)
    # runs of <= 2 queries: a twice (60 s), b once (120 s), c's 30 s window once -> (60 + 60 + 120 + 30) / 4
    assert foot.seconds == pytest.approx(67.5) and foot.runs == pytest.approx(5 / 4) and foot.samples == 5
    assert "data.train's 3 videos (5 samples)" in foot.why
    assert (foot.width, foot.height, foot.fps) == (1280, 720, 30.0)
    missing = typical_video(load_config(LONG, ["data.train=nowhere.json"]), None, "640x360")
    assert missing.seconds == 768 and "not readable here" in missing.why and missing.width == 640


def test_the_probe_runs_on_one_core_within_its_budget():
    from mmpg.data.video import VideoSpec
    from mmpg.plan.decode_probe import probe

    spec = VideoSpec(fps=1.0, max_frames=768, min_pixels=12544, max_pixels=200704, total_pixels=51380224)
    p = probe(spec, 600, sizes=((160, 96), (320, 176)), frames=8)
    assert [(r["width"], r["height"]) for r in p["sizes"]] == [(160, 96), (320, 176)]
    assert all(r["decode_s"] > 0 and r["sample_s"] >= 0 and r["bytes"] > 0 for r in p["sizes"])
    assert 0 < p["seconds"] < PROBE_BUDGET_S and p["date"] == datetime.date.today().isoformat()
    assert p["frame_pixels"] == 171267  # total_pixels / 600 x 2, under max_pixels (200,704): qwen-vl-utils' cap


def test_plan_decode_probes_this_machine(capsys, monkeypatch):
    import mmpg.plan.decode_probe as decode_probe

    real = decode_probe.probe  # the wiring, on clips small enough for the suite (the sizes are the test above's)
    monkeypatch.setattr(decode_probe, "probe", lambda spec, n: real(spec, n, sizes=((160, 96), (320, 176)), frames=8))
    p = _decode_json("--decode", "--video-minutes", "20", capsys=capsys)
    d = p["decode"]
    assert d["source"] == "probe" and [r["width"] for r in d["probe"]["sizes"]] == [160, 320]
    assert {"video_fps_per_core", "seconds_per_video", "videos_per_step", "seconds_per_step", "step_seconds",
            "keeps_up", "workers_needed", "cores_per_node", "frame_cache", "decoded_frames"} <= set(d)
    # 20 min at 1 fps reaches the 768 cap: a sample every 46.9 frames, each decoded, + the check's keyframe runs
    assert d["sampled_frames"] == 768 and d["decoded_frames"] == 36000 + KEYFRAME_FRAMES
    assert d["video_fps_per_core"] == pytest.approx(36000 / d["seconds_per_video"]) and d["seconds_per_video"] > 0
    assert d["workers_needed"] == max(1, math.ceil(d["core_seconds_per_step"] / d["step_seconds"]))
