"""Host syncs of the decode loop (issue 30, defect 6): on a GPU every `.item()`, `.tolist()`, `bool(tensor)`,
`.nonzero()` or `.cpu()` waits for the device. The loop itself (the model's forwards excluded) may make one per step
(how many rows stopped) and more only on a step where a row finishes (which rows leave the cache).

Counted on the CPU by wrapping those Tensor methods while the loop runs and unwrapping them inside each forward;
the count for S + 4 steps minus the count for S steps, no stop token, is the loop's cost of 4 steps. Seeded sampling
(prompt_seeds: one uniform per row and step from the row's own generator) is the case that drew on the host per row
per step: its uniforms are drawn once per call now, identical to the draws one at a time (tested below)."""

from __future__ import annotations

import pytest
import torch

from batches import text_batch
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout import hf

SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu")


def _count_loop_syncs(monkeypatch, engine, inputs, steps: int, seeds) -> int:
    counts, on = [0], [False]
    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            if on[0]:
                counts[0] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for step_name in ("_cascade_step", "_decode_step"):
        real_step = getattr(engine, step_name)

        def quiet(*args, _real=real_step, **kwargs):  # the model's forward is not the loop's
            on[0] = False
            try:
                return _real(*args, **kwargs)
            finally:
                on[0] = True

        monkeypatch.setattr(engine, step_name, quiet)
    real_decode = engine._decode

    def loop(*args, **kwargs):
        on[0] = True
        try:
            return real_decode(*args, **kwargs)
        finally:
            on[0] = False

    monkeypatch.setattr(engine, "_decode", loop)
    sampling = SamplingParams(max_new_tokens=steps, temperature=1.0, seed=3, stop_token_ids=())
    engine.generate_groups(inputs, [3, 2, 4], sampling, prompt_seeds=seeds)
    return counts[0]


@pytest.mark.parametrize("decode", ["cascade", "copy"])
@pytest.mark.parametrize("seeds", [None, [1, 2, 3]], ids=["generator", "prompt_seeds"])
def test_one_host_sync_per_decode_step(decode, seeds, load_tiny, monkeypatch):
    model, tokenizer = load_tiny("qwen2")
    inputs = text_batch(tokenizer, 3)
    engine = HFEngine(model, tokenizer, decode=decode)
    with monkeypatch.context() as m:
        short = _count_loop_syncs(m, engine, inputs, 4, seeds)
    with monkeypatch.context() as m:
        long = _count_loop_syncs(m, engine, inputs, 8, seeds)
    assert long - short <= 4, f"{long - short} host syncs in 4 more decode steps (at most one a step)"


def test_row_uniforms_equal_one_draw_at_a_time():
    """The seeded rows' uniforms drawn at once per call ([N, steps]) are the draws the loop made one per step."""
    seeds, sizes, steps = [11, 22], [2, 3], 7
    table = hf._row_uniforms(seeds, sizes, steps, torch.device("cpu"))
    gens = hf._row_generators(seeds, sizes)
    one_by_one = torch.stack([torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for _ in range(steps)])
                              for g in gens])
    assert table.dtype == torch.float64 and torch.equal(table, one_by_one)
