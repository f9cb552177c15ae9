"""Measure the CPU peak of one GRPO step of a bench-sized model, for `mmpg.plan.validate` (one process per case).

What is measured is what `mmpg plan --device cpu` predicts: the resident-set high-water of the process over building
the policy (and its frozen reference copy), the DeepSpeed engine and one cold GRPO step (rollout, reward, reference
logprobs, update with AdamW's first step), minus the resident set before any of it (torch, transformers and
DeepSpeed imported, the process group up, and one small step of the same kind run and dropped, so that lazily
imported modules, the tokenizer the bench trains, DeepSpeed's compiled ops and the thread pools' buffers are not
counted as the run's: they do not grow with the model or the batch). The probes are the bench's (`mmpg.bench.memory`: VmHWM after clear_refs),
with freed pages given back before each phase and blocks >= 64 KiB mapped on their own (`release`, `worker_env`),
so the high-water follows live tensors rather than what glibc keeps of freed ones. The step is the bench's step
level (`mmpg.bench.step.setup`): the trainer's own `GRPOStep`, its self-check off (a repeated forward that is not
the step's work).

    python -m mmpg.plan.measure '<case json>'     # prints one JSON line {"peak_bytes", "step_peak", ...}
"""

from __future__ import annotations

import json
import sys


def measure(case: dict) -> dict:
    import torch

    from mmpg.bench import memory as probes
    from mmpg.bench.step import setup
    from mmpg.train.engine import prepare_deepspeed_env

    device = torch.device("cpu")
    torch.set_num_threads(int(case.get("threads", 1)))
    prepare_deepspeed_env("cpu")
    import deepspeed  # noqa: F401 - imported before the baseline: its import is not the run's memory
    import transformers  # noqa: F401
    from mmpg import dist

    dist.init("cpu")
    warm(case, device)
    probes.release(device)
    base = probes.rss()
    if not probes.reset_hwm():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the CPU peak cannot be measured here")
    _, runner, info = setup(dict(case, release=True), device)
    after_setup = probes.rss() - base
    out = runner(memory=True)
    peak = probes.hwm() - base
    return {"peak_bytes": peak, "setup_bytes": after_setup, "step_peaks": out["peak_bytes"],
            "seconds": out["seconds"], "P": info["P"], "tokens": info["tokens"],
            "trainable_params": info["trainable_params"]}


def warm(case: dict, device) -> None:
    """One step of a small case of the same kind (same family, ZeRO stage, LoRA, checkpointing), dropped."""
    import gc

    from mmpg.bench.step import setup

    small = dict(case, P=64, S=4, G=2, spec=dict(case["spec"], hidden_size=32, num_layers=1,
                                                  intermediate_size=64, num_heads=4, num_kv_heads=2))
    _, runner, _ = setup(small, device)
    runner(memory=False)
    del runner
    gc.collect()


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
