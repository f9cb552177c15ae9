"""Every policy mmpg patches is loaded with transformers' hub kernels off (`use_kernels=False`): from 5.25
from_pretrained kernelizes layers by default (RMSNorm, the rotary embedding, apply_rotary_pos_emb), code the
grouped forward's equivalence tests never ran. Every supported transformers (>= 5.17) takes the keyword."""

from __future__ import annotations

import pytest

from mmpg.models.loading import load_policy


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2"])
def test_policies_load_with_hub_kernels_off(family, tiny_dirs, monkeypatch):
    import transformers

    auto = transformers.AutoModelForImageTextToText if family == "qwen2_5_vl" else transformers.AutoModelForCausalLM
    real, seen = auto.from_pretrained.__func__, []

    def recorded(cls, *args, **kwargs):
        seen.append(kwargs)
        return real(cls, *args, **kwargs)  # the installed transformers takes the keyword

    monkeypatch.setattr(auto, "from_pretrained", classmethod(recorded))
    model = load_policy(tiny_dirs[family], dtype="float32")
    assert len(seen) == 1 and seen[0].get("use_kernels") is False, seen
    assert model.use_kernels is False
