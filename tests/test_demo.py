"""The README's main job runs end to end and says what it did (slow: builds a model and renders videos)."""

from __future__ import annotations

import pytest

from mmpg.demo import run_demo


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_demo_runs_and_reports(tmp_path, capsys, family):
    assert run_demo(tmp_path / "demo", family=family) == 0
    out = capsys.readouterr().out
    assert "built now:   tiny" in out and "6 synthetic videos" in out
    assert "grouped vs repeated forward: max |logprob difference|" in out
    assert "would score 2.00" in out
    assert "3 GRPO steps" in out and "step 3: reward" in out and "mmpg inspect" in out
    from mmpg.runs import RunReader

    runs = sorted((tmp_path / "demo" / "runs").iterdir())
    assert len(runs) == 1 and [m["step"] for m in RunReader(runs[0]).metrics()] == [1, 2, 3]
    # a second run reuses what is there
    assert run_demo(tmp_path / "demo", family=family, train_steps=0) == 0
    assert "nothing (reused what was there)" in capsys.readouterr().out
