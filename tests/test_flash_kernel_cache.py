"""The flash backend's per-process kernel (`mmpg.grouping.backends.varlen.flash_kernel`): the version probe and the
signature reads run once, not per call and layer; `model.deterministic` reaches flash-attn's backward."""

from __future__ import annotations

import inspect

import pytest
import torch

from batches import completions, text_batch
from flash_standin import standin_flash_attn
from mmpg.grouping import grouped_logprobs, set_grouping_options
from mmpg.grouping.backends import varlen


@pytest.fixture
def fake_flash(monkeypatch):
    yield from standin_flash_attn(monkeypatch)


def _case(load_tiny):
    model, tokenizer = load_tiny("qwen3", dtype=torch.bfloat16)
    inputs = text_batch(tokenizer, 2)
    ids, mask = completions([2, 3], [3, 1, 4, 2, 5], model.config.vocab_size)
    return model, inputs, ids, mask, [2, 3]


def test_probe_and_signatures_are_read_once(load_tiny, fake_flash, monkeypatch):
    model, inputs, ids, mask, groups = _case(load_tiny)
    calls = {"interface": 0, "signature": 0}
    real_interface, real_signature = varlen.flash_interface, inspect.signature

    def interface():
        calls["interface"] += 1
        return real_interface()

    def signature(fn, *args, **kwargs):
        if "flash_attn" in getattr(fn, "__module__", ""):
            calls["signature"] += 1
        return real_signature(fn, *args, **kwargs)

    monkeypatch.setattr(varlen, "flash_interface", interface)
    monkeypatch.setattr(varlen.inspect, "signature", signature)
    for _ in range(2):  # two forwards and a backward through every layer: 3 kernel calls per layer and pass
        logp = grouped_logprobs(model, inputs, ids, mask, groups, backend="flash")
    logp.sum().backward()
    assert calls == {"interface": 1, "signature": 2}  # one kernel; the forward's and the backward's signature


def test_deterministic_reaches_the_backward(load_tiny, fake_flash, monkeypatch):
    model, inputs, ids, mask, groups = _case(load_tiny)
    seen = []
    real = fake_flash._flash_attn_varlen_backward

    def backward(*args, deterministic, **kwargs):
        seen.append(deterministic)
        return real(*args, deterministic=deterministic, **kwargs)

    backward._init_fn = getattr(real, "_init_fn", real)  # the argument names flash-attn's custom op takes
    monkeypatch.setattr(fake_flash, "_flash_attn_varlen_backward", backward)
    for flag in (False, True):
        set_grouping_options(model, deterministic=flag)
        grouped_logprobs(model, inputs, ids, mask, groups, backend="flash").sum().backward()
    layers = model.config.num_hidden_layers
    assert seen == [False] * 3 * layers + [True] * 3 * layers
