"""`mmpg eval` on a LoRA adapter checkpoint (through a run directory's checkpoints, as a LoRA run writes them) equals
`mmpg eval` on the model `mmpg export` merged from it: the same answers, spans, IoUs and metrics."""

from __future__ import annotations

import json

import pytest
from lora_utils import adapter_checkpoint

from mmpg.runs.checkpoints import mark_complete
from mmpg.runs.evals import EvalReader
from mmpg.runs.layout import LAYOUT_VERSION, RUN_JSON

pytestmark = pytest.mark.slow

FAST = ["fps=1", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "max_new_tokens=8", "num_workers=0",
        "batch_size=4"]


def _rows(folder):
    return [(r.index, r.sample_id, r.text, r.pred_span, r.iou, r.error) for r in EvalReader(folder).predictions()]


def _main(args, capsys):
    from mmpg.cli import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return out.out


def test_eval_of_an_adapter_checkpoint_equals_eval_of_its_export(grpo_data, tmp_path, capsys):
    run, synth = tmp_path / "run", grpo_data["synth"]
    ckpt = adapter_checkpoint(grpo_data["model"], run / "checkpoints" / "step_00000001", std=0.2)
    mark_complete(ckpt)
    (run / RUN_JSON).write_text(json.dumps({"layout_version": LAYOUT_VERSION}))
    data = ["--annotations", synth / "train.json", "--videos", synth / "videos"]
    printed = _main(["eval", "--run", run, *data, *FAST], capsys)
    assert "step 1: wrote" in printed
    adapter_eval = run / "evals" / "train" / "step_00000001"
    _main(["export", "--checkpoint", ckpt, "--out", tmp_path / "exported"], capsys)
    _main(["eval", "--checkpoint", tmp_path / "exported", *data, "--out", tmp_path / "export_eval", *FAST], capsys)
    _main(["eval", "--checkpoint", grpo_data["model"], *data, "--out", tmp_path / "base_eval", *FAST], capsys)
    ours, theirs, base = _rows(adapter_eval), _rows(tmp_path / "export_eval"), _rows(tmp_path / "base_eval")
    assert len(ours) == 11 and ours == theirs
    strip = ("layout_version",)
    m1, m2 = EvalReader(adapter_eval).metrics(), EvalReader(tmp_path / "export_eval").metrics()
    assert {k: v for k, v in m1.items() if k not in strip} == {k: v for k, v in m2.items() if k not in strip}
    changed = sum(a[2] != b[2] for a, b in zip(ours, base))
    print(f"\nadapter vs base: {changed}/{len(ours)} answers differ; adapter == export on all {len(ours)}")
    assert changed > 0, "the adapter should change some answers (else the comparison shows nothing)"
    assert EvalReader(adapter_eval).info()["checkpoint"] == str(ckpt.resolve())
