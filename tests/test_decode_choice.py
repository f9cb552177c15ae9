"""The decode path's chain and its check against copy decoding (`mmpg.rollout.decode_choice`), on the CPU.

On the CPU the check is off by default (torch's CPU kernel is tested here); `decode_check="on"` runs it as it runs on
CUDA. Faults are injected by swapping a kernel of `cascade_kernels.KERNELS`: one that shifts its output (disagrees)
and one that raises. Each must be dropped with one warning line, the next kernel taken, and the choice recorded in
`mmpg.choices`; the rollout that follows is the copy path's, token for token."""

from __future__ import annotations

import logging

import pytest
import torch

from batches import vl_batch
from mmpg import choices
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout import cascade_kernels, decode_choice
from mmpg.rollout.decode_choice import compare, kernel_chain
from mmpg.rollout.engine import Rollout

VIDEOS = [(4, 56, 84), None, (6, 56, 112)]
SIZES = [2, 1, 3]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())


@pytest.fixture(autouse=True)
def fresh_choices():
    choices.reset()
    yield
    choices.reset()


def test_chain_fastest_first_down_to_copy(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel_chain("cascade", "auto", cpu, torch.float32) == ["sdpa", "math", "copy"]
    assert kernel_chain("cascade", "math", cuda, torch.bfloat16) == ["math", "copy"]
    assert kernel_chain("copy", "auto", cuda, torch.bfloat16) == ["copy"]
    monkeypatch.setattr(decode_choice, "flash_usable", lambda device, dtype: (dtype == torch.bfloat16, ""))
    assert kernel_chain("cascade", "auto", cuda, torch.bfloat16) == ["flash", "sdpa", "math", "copy"]
    assert kernel_chain("cascade", "auto", cuda, torch.float32) == ["sdpa", "math", "copy"]
    assert not decode_choice.flash_usable(cuda, torch.float32)[0]  # no fp32 flash kernels, before any import


def _rollout(ids, logps):
    ids, logps = torch.tensor(ids), torch.tensor(logps)
    return Rollout(completion_ids=ids, completion_mask=torch.ones_like(ids), group_sizes=[ids.shape[0]],
                   texts=[""] * ids.shape[0], finish_reasons=["length"] * ids.shape[0], logprobs=logps)


def test_compare_tokens_and_logprobs_by_hand():
    ref = _rollout([[5, 6, 7]], [[-0.1, -0.2, -0.7]])
    assert compare(ref, _rollout([[5, 6, 7]], [[-0.1, -0.2, -0.70005]]), 1e-4)[0]  # 5e-5 <= 1e-4
    ok, figure, _ = compare(ref, _rollout([[5, 6, 7]], [[-0.1, -0.3, -0.7]]), 1e-4)
    assert not ok and abs(figure - 0.1) < 1e-6
    # a near-tie broken the other way at step 1 (chosen logprobs -0.69315 vs -0.69320): compared up to it, passes
    assert compare(_rollout([[5, 6, 7]], [[-0.1, -0.69315, -0.1]]),
                   _rollout([[5, 8, 9]], [[-0.1, -0.69320, -3.0]]), 1e-4)[0]
    ok, _, where = compare(ref, _rollout([[5, 8, 7]], [[-0.1, -1.5, -0.7]]), 1e-4)  # a different token, not a tie
    assert not ok and where == "row 0 token 1: 8 instead of 6"
    assert not compare(ref, _rollout([[5, 6, 7]], [[-0.1, float("nan"), -0.7]]), 1e-4)[0]


@pytest.fixture(scope="module")
def vl(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    return model, processor, vl_batch(processor, "qwen2_5_vl", VIDEOS)


def test_check_off_by_default_on_the_cpu(vl):
    model, processor, inputs = vl
    HFEngine(model, processor).generate_groups(inputs, SIZES, GREEDY)
    assert choices.current()["decode_kernel"] == {"value": "sdpa", "why": "unchecked (decode_check off)"}


def test_check_passes_and_reruns_only_past_the_envelope(vl, monkeypatch):
    model, processor, inputs = vl
    engine = HFEngine(model, processor, decode_check="on")
    checks = []
    real = engine.check_decode
    monkeypatch.setattr(engine, "check_decode", lambda *a: checks.append(a[1:4]) or real(*a))
    out = engine.generate_groups(inputs, SIZES, GREEDY)
    engine.generate_groups(inputs, SIZES, GREEDY)  # the same batch: covered
    assert len(checks) == 1 and checks[0][1:] == (3, decode_choice.STEPS)  # G_max rows of each picked prompt
    assert len(checks[0][0]) == 2  # the longest prompt and the shortest
    engine.generate_groups(inputs, [4, 1, 1], GREEDY)  # a larger group: checked again
    assert len(checks) == 2 and checks[1][1] == 4
    assert choices.current()["decode_kernel"] == {"value": "sdpa", "why": ""}
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, SIZES, GREEDY)
    assert torch.equal(out.completion_ids, copy.completion_ids)


def _shifted(q, k, v, key_mask, scale):
    out, lse = cascade_kernels._math(q, k, v, key_mask, scale)
    return out + 0.5, lse


def _raises(q, k, v, key_mask, scale):
    raise RuntimeError("no kernel image is available for execution on the device")


@pytest.mark.parametrize("fault", [_shifted, _raises], ids=["disagrees", "raises"])
def test_faulty_kernel_dropped_next_taken(fault, vl, monkeypatch, caplog):
    model, processor, inputs = vl
    monkeypatch.setitem(cascade_kernels.KERNELS, "sdpa", fault)
    engine = HFEngine(model, processor, decode_check="on")
    with caplog.at_level(logging.WARNING, logger="mmpg.rollout"):
        out = engine.generate_groups(inputs, SIZES, GREEDY)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "kernel sdpa" in lines[0] and "next: math" in lines[0] and "torch " in lines[0]
    assert ("max |logprob difference|" if fault is _shifted else "raised RuntimeError") in lines[0]
    chosen = choices.current()["decode_kernel"]
    assert chosen["value"] == "math" and chosen["why"].startswith("sdpa dropped:")
    assert engine.choice.current == "math"
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, SIZES, GREEDY)
    assert torch.equal(out.completion_ids, copy.completion_ids)
    assert float((out.logprobs - copy.logprobs).abs().max()) < 1e-5


def test_every_kernel_faulty_down_to_copy(vl, monkeypatch, caplog):
    model, processor, inputs = vl
    monkeypatch.setitem(cascade_kernels.KERNELS, "sdpa", _raises)
    monkeypatch.setitem(cascade_kernels.KERNELS, "math", _shifted)
    with caplog.at_level(logging.WARNING, logger="mmpg.rollout"):
        out = HFEngine(model, processor, decode_check="on").generate_groups(inputs, SIZES, GREEDY)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2
    chosen = choices.current()["decode_kernel"]
    assert chosen["value"] == "copy" and chosen["why"].startswith("math dropped:")
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, SIZES, GREEDY)
    assert torch.equal(out.completion_ids, copy.completion_ids)


def test_synced_decoding_checks_by_vote(vl, monkeypatch):
    """One rank simulated: all_done(x) -> x. The vote runs the same check and the same drop as unsynced."""
    model, processor, inputs = vl
    monkeypatch.setitem(cascade_kernels.KERNELS, "sdpa", _shifted)
    votes = []
    engine = HFEngine(model, processor, decode_check="on", all_done=lambda done: votes.append(done) or done)
    out = engine.generate_groups(inputs, SIZES, GREEDY)
    assert engine.choice.current == "math" and votes[:1] == [False]  # the first vote: this rank needs a check
    copy = HFEngine(model, processor, decode="copy").generate_groups(inputs, SIZES, GREEDY)
    assert torch.equal(out.completion_ids, copy.completion_ids)


def test_bad_check_mode(vl):
    model, processor, _ = vl
    with pytest.raises(ValueError, match="decode_check='sometimes'; choose one of auto, on, off"):
        HFEngine(model, processor, decode_check="sometimes")


def test_settings_reach_the_engine(load_tiny, monkeypatch):
    """rollout.cascade_backend / decode_check (training, held-out eval) and mmpg eval's settings of the same names
    reach HFEngine; bad values are one error line naming the choices."""
    from mmpg.config import load_config
    from mmpg.errors import UserError
    from mmpg.eval.settings import load_settings, numbers_settings
    from mmpg.rl import grpo
    from mmpg.rollout import hf
    from mmpg.train.heldout import heldout_settings

    cfg = load_config(None, ["rollout.cascade_backend=math", "rollout.decode_check=on"])
    s = heldout_settings(cfg)
    assert (s.decode, s.cascade_backend, s.decode_check) == ("auto", "math", "on")
    with pytest.raises(UserError, match="rollout.cascade_backend.*auto, flash, sdpa, math"):
        load_config(None, ["rollout.cascade_backend=xla"])
    e = load_settings("default", ["cascade_backend=flash", "decode_check=off", "decode=copy"])
    assert (e.decode, e.cascade_backend, e.decode_check) == ("copy", "flash", "off")
    assert "cascade_backend" not in numbers_settings(e)  # the same answers, only faster
    with pytest.raises(UserError, match="decode_check.*auto, on, off"):
        load_settings("default", ["decode_check=sometimes"])
    seen = {}

    class Built(Exception):
        pass

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(hf, "HFEngine", capture)  # what `mmpg.rollout.build` builds for rollout.engine=hf
    model, processor = load_tiny("qwen2")
    engine = type("E", (), {"module": type("M", (), {"policy": model})()})()
    with pytest.raises(Built):
        grpo.GRPOStep(cfg, engine, None, processor, (), None, "cpu")
    assert seen["cascade_backend"] == "math" and seen["decode_check"] == "on"


def test_mmpg_eval_takes_the_same_decision(grpo_data, tmp_path, monkeypatch):
    """`mmpg eval` decodes through the same engine decision: with decode_check=on and a faulty sdpa kernel it steps
    down to math, and its report's fast paths name the choice and why."""
    from mmpg.eval.runner import evaluate_checkpoint
    from mmpg.eval.settings import load_settings

    monkeypatch.setitem(cascade_kernels.KERNELS, "sdpa", _shifted)
    synth = grpo_data["synth"]
    fast = ["fps=1", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "max_new_tokens=8", "num_workers=0",
            "decode_check=on"]
    result = evaluate_checkpoint(grpo_data["model"], synth / "test.json", synth / "videos", tmp_path / "out",
                                 load_settings("default", fast))
    assert result.decoded == 2
    assert choices.current()["decode_kernel"]["value"] == "math"
    monkeypatch.undo()  # torch's kernel again, unchecked
    unchecked = evaluate_checkpoint(grpo_data["model"], synth / "test.json", synth / "videos", tmp_path / "off",
                                    load_settings("default", fast[:-1] + ["decode_check=off"]))
    assert result.metrics["perf/vision_calls"] == unchecked.metrics["perf/vision_calls"] > 0  # the check uncounted
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| decode_kernel | math |" in report and "sdpa dropped" in report


@pytest.mark.slow
def test_grpo_run_records_the_checked_kernel(grpo_data, tmp_path):
    """`mmpg train` with rollout.decode_check=on: the rollout engine checks its kernel on the first batch and the run
    records it (run.json fast_paths, the train log's fast-paths line)."""
    from train_utils import overrides, run_cli

    from mmpg.runs import RunReader

    args = overrides(grpo_data, tmp_path, "r", **{"trainer.total_steps": 1, "rollout.decode_check": "on",
                                                   "reward.function": ""})
    proc = run_cli(["train"] + args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert RunReader(tmp_path / "r").info()["fast_paths"]["decode_kernel"] == {"value": "sdpa", "why": ""}
    assert "decode kernel sdpa passed its check" in (tmp_path / "r" / "train.log").read_text()
