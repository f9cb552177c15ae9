"""Trivial baselines, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from mmpg.data.samples import GroundingSample
from mmpg.eval.baselines import mean_relative_span, trivial_baselines


def _s(i: int, duration, span) -> GroundingSample:
    return GroundingSample(f"v{i}", f"v{i}.mp4", duration, "a white circle appears", span, origin=f"x.json[{i}]")


TRAIN = [_s(0, 10.0, (2.0, 4.0)), _s(1, 10.0, (4.0, 8.0))]  # as fractions: (0.2, 0.4) and (0.4, 0.8)
TEST = [_s(2, 20.0, (6.0, 12.0)), _s(3, 10.0, (0.0, 5.0))]


def test_mean_relative_span():
    assert mean_relative_span(TRAIN) == pytest.approx((0.3, 0.6))


def test_whole_video_and_mean_span_by_hand():
    b = trivial_baselines(TRAIN, TEST)
    whole, mean = b["whole video"], b["mean train span"]
    # whole video: [0, 20] vs [6, 12] -> 6/20 = 0.3; [0, 10] vs [0, 5] -> 0.5
    assert whole["miou"] == pytest.approx(0.4)
    assert (whole["r1@0.3"], whole["r1@0.5"], whole["r1@0.5_ge"], whole["r1@0.7"]) == (0.5, 0.0, 0.5, 0.0)
    # mean span: [6, 12] on a 20 s video -> exact, 1.0; [3, 6] vs [0, 5] -> 2 / 6 = 1/3
    assert mean["miou"] == pytest.approx((1.0 + 1 / 3) / 2)
    assert (mean["r1@0.3"], mean["r1@0.5"], mean["r1@0.7"]) == (1.0, 0.5, 0.5)
    assert whole["unparseable"] == mean["unparseable"] == 0.0 and whole["count"] == 2.0


def test_a_sample_without_duration_is_named():
    with pytest.raises(ValueError, match=r"x.json\[5\] \(sample v5\).*duration"):
        trivial_baselines(TRAIN, [_s(5, None, (1.0, 2.0))])
    with pytest.raises(ValueError, match="at least one training sample"):
        trivial_baselines([], TEST)
