"""Each protocol's frame budgets, query cleaning and denominators, from the rules of its paper's released code.

Budgets (tokens x the family's token size, 28 x 28 pixels for Qwen2.5-VL, 32 x 32 for Qwen3-VL):
  TimeLens (scripts/eval_timelens_bench.sh; evaluation/utils.py multiplies by downsample_rate ** 2, 32 for Qwen3-VL
  and 28 for Qwen2.5-VL; the pinned qwen-vl-utils 0.0.14 caps a frame at 768 x (2 x image_patch_size) ** 2):
      min 64 tokens, total 14336, max 768
  Time-R1 / VideoChat-R1 (16*28*28, 3584*28*28, their vision_process copies' 768*28*28; Qwen2.5-VL only):
      min 16 tokens, total 3584, max 768
Queries: TimeLens `parse_query` (whitespace runs -> " ", strip, strip(".") at both ends), Time-R1's Charades-STA
loader `.strip()`, its TVGBench loader and VideoChat-R1 the text as written. Duplicates: TimeLens counts a
(video, query, span) once (a dict), the others every record.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmpg.data.formats import load_annotations
from mmpg.data.queries import clean_query
from mmpg.data.samples import GroundingSample
from mmpg.errors import UserError
from mmpg.eval.protocols import eval_template
from mmpg.eval.settings import load_settings

REAL = Path(__file__).resolve().parent.parent / ".." / "shared" / "data" / "real"  # ../shared from the repository root
PAPERS = ("time_r1", "tvgbench", "videochat_r1", "timelens")


@pytest.fixture
def prompt(tmp_path) -> str:
    path = tmp_path / "prompt.txt"
    path.write_text('Find "{query}".')
    return f"prompt_file={path}"


@pytest.mark.parametrize("protocol, family, pixels", [
    # (min, max per frame, total) = tokens x 28 x 28 (Qwen2.5-VL) or x 32 x 32 (Qwen3-VL)
    ("timelens", "qwen3_vl", (64 * 32 * 32, 768 * 32 * 32, 14336 * 32 * 32)),  # 65,536 / 786,432 / 14,680,064
    ("timelens", "qwen2_5_vl", (64 * 28 * 28, 768 * 28 * 28, 14336 * 28 * 28)),  # 50,176 / 602,112 / 11,239,424
    ("time_r1", "qwen2_5_vl", (16 * 28 * 28, 768 * 28 * 28, 3584 * 28 * 28)),  # 12,544 / 602,112 / 2,809,856
    ("time_r1", "qwen3_vl", (16 * 32 * 32, 768 * 32 * 32, 3584 * 32 * 32)),  # the tokens kept (assumed)
    ("tvgbench", "qwen2_5_vl", (16 * 28 * 28, 768 * 28 * 28, 3584 * 28 * 28)),
    ("videochat_r1", "qwen2_5_vl", (16 * 28 * 28, 768 * 28 * 28, 3584 * 28 * 28)),
    ("videochat_r1", "qwen3_vl", (16 * 32 * 32, 768 * 32 * 32, 3584 * 32 * 32)),
])
def test_budgets_per_family(protocol, family, pixels, prompt):
    v = load_settings(protocol, [prompt]).video_values_for(family)
    assert (v["min_pixels"], v["max_pixels"], v["total_pixels"]) == pixels
    assert (v["fps"], v["min_frames"], v["max_frames"]) == (2.0, 4, 768)


def test_default_protocol_leaves_mmpg_token_defaults_to_the_family():
    v = load_settings().video_values_for("qwen3_vl")
    assert (v["min_pixels"], v["max_pixels"], v["total_pixels"]) == (None, None, None)


def _fetch(element: dict, patch: int, source: tuple[int, float, int, int], monkeypatch) -> tuple[int, int, int]:
    """(frames, height, width) qwen-vl-utils' fetch_video makes of a stand-in video of `source` = (frames, fps,
    height, width) under `element`: the real smart_nframes and sizing, no decoding and no resizing."""
    from qwen_vl_utils import vision_process as qv

    import mmpg.data.video  # noqa: F401 - forces the decord reader, which the stand-in replaces

    total, fps, h, w = source

    def read(ele):
        n = qv.smart_nframes(ele, total_frames=total, video_fps=fps)
        meta = dict(fps=fps, frames_indices=list(range(n)), total_num_frames=total, video_backend="decord")
        return torch.zeros(1, 3, h, w, dtype=torch.uint8).expand(n, 3, h, w), meta, n / total * fps

    seen = []

    def resize(video, size, **_):
        seen.append((video.shape[0], *size))
        return torch.zeros(0)

    monkeypatch.setitem(qv.VIDEO_READER_BACKENDS, qv.get_video_reader_backend(), read)
    monkeypatch.setattr(qv, "transforms", SimpleNamespace(functional=SimpleNamespace(resize=resize)))
    qv.fetch_video(dict(element, video="stand-in.mp4"), image_patch_size=patch, return_video_metadata=True)
    return seen[0]


@pytest.mark.parametrize("family, patch, rate", [("qwen3_vl", 16, 32), ("qwen2_5_vl", 14, 28)])
@pytest.mark.parametrize("source", [(900, 30.0, 360, 640),  # 30 s: 60 frames, the total budget binds
                                    (200, 25.0, 1080, 1920),  # 8 s: 16 frames, the per-frame cap binds
                                    (9000, 30.0, 240, 320),  # 300 s: 600 frames, min_pixels * 1.05 binds
                                    (54000, 30.0, 480, 854)])  # 30 min: 768 frames (FPS_MAX_FRAMES)
def test_timelens_frames_equal_its_code_through_qwen_vl_utils(family, patch, rate, source, prompt, monkeypatch):
    """TimeLens's video element, as GroundingDataset builds it (min_tokens / total_tokens x downsample_rate ** 2,
    fps; image_patch_size 16 for Qwen3-VL, qwen-vl-utils' 14 for Qwen2.5-VL), and mmpg's under `timelens` give the
    same frames and frame size through the pinned qwen-vl-utils."""
    from mmpg.data.video import VideoSpec

    theirs = {"type": "video", "min_pixels": 64 * rate * rate, "total_pixels": 14336 * rate * rate, "fps": 2}
    spec = VideoSpec.for_family(family, **load_settings("timelens", [prompt]).video_values_for(family))
    assert spec.image_patch_size == patch
    ours = {k: v for k, v in spec.element("stand-in.mp4").items() if k != "video"}
    assert _fetch(ours, spec.image_patch_size, source, monkeypatch) == _fetch(theirs, patch, source, monkeypatch)


def test_a_pixel_setting_clears_its_token_twin(prompt):
    s = load_settings("timelens", [prompt, "min_pixels=3136"])
    assert (s.min_pixels, s.min_tokens, s.total_tokens) == (3136, None, 14336)
    assert s.video_values_for("qwen3_vl")["min_pixels"] == 3136  # absolute for every family
    s = load_settings("default", ["total_pixels=100352", "total_tokens=64"])
    assert (s.total_pixels, s.video_values_for("qwen2_5_vl")["total_pixels"]) == (None, 64 * 28 * 28)
    with pytest.raises(UserError, match="'max_tokens' is 0"):
        load_settings("default", ["max_tokens=0"])
    from mmpg.eval.settings import EvalSettings, _validate

    with pytest.raises(UserError, match="'min_pixels' and 'min_tokens' are both set"):
        _validate(EvalSettings(min_pixels=3136, min_tokens=4))


@pytest.mark.parametrize("text, rule, cleaned", [
    ("a person is putting a book on a shelf.", "mmpg", "a person is putting a book on a shelf"),
    ("a person is putting a book on a shelf.", "strip", "a person is putting a book on a shelf."),
    (" One man is holding a rope.", "strip", "One man is holding a rope."),
    (" One man is holding a rope.", "as_written", " One man is holding a rope."),
    ("beat the egg with cinnamon ", "as_written", "beat the egg with cinnamon "),
    ("  a white   circle\nappears.  ", "timelens", "a white circle appears"),
    (".a white square appears..", "timelens", "a white square appears"),  # a leading period goes too
    (".a white square appears..", "mmpg", ".a white square appears"),  # mmpg's own rule keeps it
    ("a . b .", "timelens", "a . b"),  # strip(".") then strip(): the space before the last period goes
])
def test_query_cleaning_rules(text, rule, cleaned):
    assert clean_query(text, rule) == cleaned


@pytest.mark.parametrize("protocol, query, shown", [
    ("time_r1", "a person sits down.", 'Find "a person sits down.".'),  # load_charades: .strip() only
    ("tvgbench", "beat the egg ", 'Find "beat the egg ".'),  # load_tvgbench: the question as is
    ("videochat_r1", " One man dances.", 'Find " One man dances.".'),  # GROUND_TEMPLATE.replace('[EVENT]', ...)
    ("timelens", ".a white  square appears..", 'Find "a white square appears".'),  # parse_query
    ("default", "a person sits down.", 'Find "a person sits down".'),  # mmpg's training rule
])
def test_each_protocol_puts_the_query_as_its_code_does(protocol, query, shown, prompt, tmp_path):
    """The query goes through the loader (which strips and keeps the text as written) and the protocol's rule."""
    ann = tmp_path / "a.jsonl"
    ann.write_text(json.dumps({"video": "v.mp4", "duration": 10, "query": query, "span": [1, 2]}) + "\n")
    sample = load_annotations(ann).samples[0]
    assert sample.query == query.strip() and sample.raw_query == (query if query != query.strip() else None)
    s = load_settings(protocol, [prompt])
    assert eval_template(s.template, s.prompt_file, s.query_clean).render(sample) == shown


def test_loaders_keep_the_text_as_written_and_train_on_the_stripped_one(tmp_path):
    """ActivityNet Captions' leading spaces (VideoChat-R1's anet copy) and TimeLens-Bench's whitespace runs: the
    sample's query is stripped (squashed for TimeLens-Bench) as before, raw_query is the file's text."""
    anet = tmp_path / "anet.json"
    anet.write_text(json.dumps({"v_x": {"duration": 20.0, "timestamps": [[1, 5], [2, 6]],
                                        "sentences": [" A man runs.", "He stops."]}}))
    a, b = load_annotations(anet).samples
    assert (a.query, a.raw_query, b.query, b.raw_query) == ("A man runs.", " A man runs.", "He stops.", None)
    assert eval_template("time_r1").render(a).count('"A man runs"') == 1  # training's prompt: unchanged
    lens = tmp_path / "lens.json"
    lens.write_text(json.dumps({"v": {"duration": 9.0, "spans": [[1, 2]], "queries": ["a  b\nc. "]}}))
    (c,) = load_annotations(lens, fmt="timelens").samples
    assert (c.query, c.raw_query) == ("a b c.", "a  b\nc. ")


def _record(i, video, query, span, iou, error=None):
    from mmpg.runs.evals import PredictionRecord

    return PredictionRecord(index=i, sample_id=f"s{i}", video=video, duration=20.0, query=query, gt_span=span,
                            pred_span=None if error else [0.0, 1.0], text="", iou=iou, error=error)


def test_timelens_counts_a_repeated_record_once():
    """Four records; the first two share TimeLens's key (file name, query as parse_query cleans it, span), the
    fourth has the same query on another span. TimeLens's dict keeps one per key, the last prediction: ious
    0.0 (s1, replacing s0's 1.0), 0.5, 0.6 -> mIoU 1.1 / 3; every record: (1.0 + 0.0 + 0.5 + 0.6) / 4 = 0.525."""
    from mmpg.eval.metrics import denominator_metrics

    records = [_record(0, "/a/v1.mp4", "A door opens.", [1.0, 4.0], 1.0),
               _record(1, "/b/v1.mp4", " A door  opens", [1.0, 4.0], 0.0),
               _record(2, "/a/v2.mp4", "A door opens.", [1.0, 4.0], 0.5),
               _record(3, "/a/v1.mp4", "A door opens.", [2.0, 4.0], 0.6)]
    once, counted = denominator_metrics(records, "fail", "once")
    assert [r.index for r in counted] == [1, 2, 3]
    assert (once["count"], once["miou"], once["duplicate_records"]) == (3.0, pytest.approx(1.1 / 3), 1.0)
    assert (once["r1@0.5"], once["r1@0.5_ge"]) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert (once["every_record/count"], once["every_record/miou"]) == (4.0, pytest.approx(0.525))
    every, counted = denominator_metrics(records, "fail", "count")
    assert (every["count"], every["miou"], every["counted_once/miou"]) == (4.0, pytest.approx(0.525),
                                                                         pytest.approx(1.1 / 3))
    assert len(counted) == 4 and every["duplicates"] == "count"
    plain, _ = denominator_metrics(records[2:], "fail", "once")
    assert plain["duplicate_records"] == 0.0 and not any("/" in k for k in plain)


def test_report_says_which_denominator_it_uses():
    from mmpg.eval.markdown import eval_report
    from mmpg.eval.metrics import denominator_metrics

    records = [_record(0, "v1.mp4", "a", [1.0, 4.0], 1.0), _record(1, "v1.mp4", "a.", [1.0, 4.0], 0.0)]
    metrics, _ = denominator_metrics(records, "fail", "once")
    info = {"benchmark": "b", "protocol": "timelens", "annotations_records": 2, "benchmark_size": 2,
            "annotations_left_out_count": 0, "evaluated": 2,
            "settings": {"scoring": "timelens", "bad_videos": "fail", "threshold_rule": "ge"}}
    report = eval_report(info, metrics, records)
    assert ("records repeating an earlier one's (video, query, span): **1**; the metrics above count each such key "
            "once, as TimeLens's compute_metrics.py does (duplicates=once); counting every record instead: 2 scored, "
            "R1@0.3/0.5/0.7 50.00/50.00/50.00 % (tIoU >= m (VideoChat-R1)), mIoU 50.00 %") in report
    assert "scored: **1**" in report


@pytest.mark.skipif(not (REAL / "charades_train.json").is_file(), reason="the public annotation files are absent")
def test_charades_sta_train_counts_through_the_loader():
    """docs/evaluation.md and data/README.md: 12,408 records, 12,404 loaded for training (4 start >= end, three of
    them also starting past the duration), all 12,408 under a paper's scoring."""
    path = REAL / "charades_train.json"
    data = json.loads(path.read_text())
    train = load_annotations(path, strict=False, log_skips=False)
    papers = load_annotations(path, strict=False, log_skips=False, keep_all=True)
    assert (len(train.samples), len(train.skipped), len(papers.samples)) == (12404, 4, 12408)
    assert all(">= end" in s.reason for s in train.skipped)
    where = [(s.where.split("'")[1], int(s.where.rsplit(" ", 1)[1])) for s in train.skipped]  # "...['ID'] sentence K"
    past = [v for v, k in where if data[v]["timestamps"][k][0] >= data[v]["duration"]]
    assert sorted(past) == ["AKKWU", "AKKWU", "LEOL6"]  # 38 s in 12.27 s twice, 8 s in 6.27 s; IOL8Q starts inside


def test_every_papers_protocol_names_its_query_rule_and_budgets(prompt):
    from mmpg.eval.protocols import PROTOCOLS

    for name in PAPERS:
        s, source = load_settings(name, [prompt]), PROTOCOLS[name].source
        assert f"query_clean {s.query_clean}" in source and "min_tokens" in source, name
        assert "mmpg drops" not in source and "drops a trailing period" not in source, name
    assert [load_settings(n, [prompt]).duplicates for n in PAPERS] == ["count", "count", "count", "once"]
    assert GroundingSample("v#0", "v.mp4", 1.0, "q", (0.0, 1.0)).raw_query is None
