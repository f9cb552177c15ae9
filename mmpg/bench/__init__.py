"""Benchmarks of the grouped forward: programs that print tables and write JSON, never timed tests.

    mmpg bench --preset cpu-targets          (`python -m mmpg.bench.cli`, `bash scripts/bench.sh`)

Every level is one row of `mmpg.bench.levels.LEVELS`, each measured against its baseline and, where it can be wired,
the upstream PyPI package `prefix_grouper==0.0.1.post1`:
    attention  one attention layer forward + backward      naive | upstream | mmpg      `mmpg.bench.attention`
    model      one training step on a random-weight model  repeated | upstream | mmpg   `mmpg.bench.model`
    rollout    sampling G responses                         hf_generate | mmpg | vllm   `mmpg.bench.rollout`
    step       one whole GRPO step of the trainer, per      naive | mmpg | tree         `mmpg.bench.step`
               phase (rollout, reward, logprob, update)
    eval       greedy answers to a video's queries          hf_generate | mmpg | tree   `mmpg.bench.evaluation`
    lora, async, vllm, data  programs with their own table: LoRA's memory (`mmpg.bench.lora`), rollout/training
               overlap (`mmpg.bench.overlap`), two ranks on one vLLM server (`mmpg.bench.serving`), video decoding
               on one core (`mmpg.bench.data`)
Each measurement runs in a fresh process (`mmpg.bench.measure`; memory: `mmpg.bench.memory`), variants interleaved
over rounds (`mmpg.bench.runner`); each row shows the ceilings of `mmpg.bench.flops` beside the measured speed-up.
Apart from the levels: `python -m mmpg.bench.sdpa_kernels` (the SDPA kernels of the sdpa backend's masked path),
`python -m mmpg.bench.prefill` (chunked prefill's memory), `python -m mmpg.bench.inspector` (the inspector's timings),
`python -m mmpg.bench.zoom` (a trajectory tree's update against the per-branch forward).
"""

from mmpg.bench.flops import paper_reduction, rho_attn, rho_flops, rho_lin, step_flops

__all__ = ["paper_reduction", "rho_attn", "rho_flops", "rho_lin", "step_flops"]
