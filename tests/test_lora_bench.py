"""`mmpg bench --levels lora` on the tiny preset's step shape, in this process: the variants build and step, and the
sizes it reports are the tensors' (trainable parameters, optimizer state, reference copy). Nothing timed."""

from __future__ import annotations

import types

from mmpg.bench import lora
from mmpg.bench.presets import TINY_SPEC, step


def test_lora_variants_step_and_report_their_sizes(step_process):
    base = {k: v for k, v in step(48, 6, 3, "qwen2_5_vl", TINY_SPEC).items() if k != "variants"}
    got = {name: lora.measure(dict(base, variant="mmpg", lora_r=4 if adapt else 0, ref=ref))
           for name, (adapt, ref) in lora.VARIANTS.items()}
    full, copy, off = got["full+copy"], got["lora+copy"], got["lora+off"]
    assert full["params"] == copy["params"] == off["params"] > full["trainable"] > copy["trainable"] == off["trainable"]
    for r in got.values():  # AdamW: exp_avg and exp_avg_sq per trainable float32 weight, and a step counter each
        assert 8 * r["trainable"] <= r["optim_bytes"] <= 8 * r["trainable"] + 8 * 1024
    assert full["ref_bytes"] > 0 and copy["ref_bytes"] > 0 and off["ref_bytes"] == 0


def test_lora_table_and_plan():
    args = types.SimpleNamespace(lora_r=8, family="qwen2_5_vl", P=[64], S=None, G=None)
    planned = lora.cases(args)
    assert [(s, v) for s, v, _ in planned] == [(s, v) for s in lora.SIZES for v in lora.VARIANTS]
    assert all(c["P"] == 64 and c["lora_r"] in (0, 8) for _, _, c in planned)
    row = {"size": "cpu", "variant": "lora+off", "params": 2e6, "trainable": 1000, "optim_bytes": 8000,
           "ref_bytes": 0, "setup_bytes": 2 ** 20, "step_bytes": None, "step_s": 1.0}
    table = lora.format_table([row, {"size": "cpu", "variant": "full+copy", "error": "OOM"}])
    assert "n/a" in table and "full+copy  error: OOM" in table
