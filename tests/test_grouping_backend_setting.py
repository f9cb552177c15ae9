"""model.grouping_backend reaches the grouped forward: the trainer's and SFT's session set-up (`grouping_options`, also
used for the reference and the bench's step), the bench's step config and `mmpg eval`'s model loading."""

from __future__ import annotations

import pytest
import torch

from mmpg.grouping import grouping_state

from batches import completions, text_batch
from mmpg.config import load_config
from mmpg.grouping import grouped_logprobs
from mmpg.grouping.backends import get_backend


@pytest.fixture
def used(monkeypatch):
    """The backend names the grouped attention asks for; each runs as sdpa here (flex would compile, flash needs
    flash-attn), so only the choice is observed."""
    import mmpg.grouping.attention as attention

    names = []

    def spy(name):
        names.append(name)
        return get_backend("sdpa")

    monkeypatch.setattr(attention, "get_backend", spy)
    return names


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_the_session_setting_is_the_backend_used(load_tiny, used, backend):
    from mmpg.train.setup import grouping_options

    model, tokenizer = load_tiny("qwen3")
    cfg = load_config(None, [f"model.grouping_backend={backend}"])
    grouping_options(model, cfg)
    ids, mask = completions([2], [3, 2], model.config.vocab_size)
    with torch.no_grad():
        grouped_logprobs(model, text_batch(tokenizer, 1), ids, mask, [2])
    assert used and set(used) == {backend}


def test_deterministic_setting_reaches_the_model(load_tiny, monkeypatch):
    from mmpg.train.setup import grouping_options

    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    model, _ = load_tiny("qwen3")
    grouping_options(model, load_config(None, ["model.deterministic=true"]))
    assert grouping_state(model).deterministic is True
    import os

    assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"  # transformers' flash_attention_2 reads it


def test_bench_step_config_carries_the_variants_backend():
    from mmpg.bench.step import step_config

    assert step_config({"G": 2, "S": 4, "backend": "flex"}, grouping=True).model.grouping_backend == "flex"
    assert step_config({"G": 2, "S": 4}, grouping=True).model.grouping_backend == "auto"


def test_eval_loads_the_model_with_its_setting(tiny_dirs):
    from mmpg.eval.runner import load_model
    from mmpg.eval.settings import load_settings

    settings = load_settings("default", ["grouping_backend=flex", "dtype=float32"])
    model = load_model(str(tiny_dirs["qwen2_5_vl"]), settings, "cpu")[0]
    assert grouping_state(model).backend == "flex"
    with pytest.raises(Exception, match="grouping_backend"):
        load_settings("default", ["grouping_backend=fast"])


def test_grpo_records_the_checks_choice_and_moves_the_reference_along(load_tiny):
    """After the self-check fell back (`SelfCheck.choice` with a reason), the GRPO step records it in mmpg.choices
    and gives a loaded reference the same backend; a check that keeps the set-up choice changes nothing."""
    import types

    from mmpg import choices
    from mmpg.grouping import set_grouping_options
    from mmpg.rl.grpo import GRPOStep

    policy, _ = load_tiny("qwen3")
    ref, _ = load_tiny("qwen3")
    set_grouping_options(ref, backend="flash")
    choices.reset()
    try:
        choices.record("grouped_backend", "sdpa", "model.grouping_backend=auto on cpu in float32")
        step = types.SimpleNamespace(checker=types.SimpleNamespace(choice=("sdpa", "")), ref=ref, policy=policy)
        before = choices.version()
        GRPOStep._record_backend(step)
        assert choices.version() == before and grouping_state(ref).backend == "flash"
        step.checker.choice = ("sdpa", "flash differs by 0.31 > bound 0.027 in the self-check (bfloat16, ...)")
        GRPOStep._record_backend(step)
        assert choices.current()["grouped_backend"] == {"value": "sdpa", "why": step.checker.choice[1]}
        assert grouping_state(ref).backend == "sdpa"
    finally:
        choices.reset()
