"""Benchmarks of the grouped forward: programs that print tables and write JSON, never timed tests.

    python -m mmpg.bench.cli --preset cpu-targets          (`mmpg bench ...` once wired into mmpg/cli.py)

Four levels (`mmpg.bench.levels`), each against its baseline and, where it can be wired, the upstream PyPI package
`prefix_grouper==0.0.1.post1`:
    attention  one attention layer forward + backward      naive | upstream | mmpg      `mmpg.bench.attention`
    model      one training step on a random-weight model  repeated | upstream | mmpg   `mmpg.bench.model`
    rollout    sampling G responses                         hf_generate | mmpg          `mmpg.bench.rollout`
    step       one whole GRPO step of the trainer, per      naive | mmpg                `mmpg.bench.step`
               phase (rollout, reward, logprob, update)
Each measurement runs in a fresh process (`mmpg.bench.measure`; memory: `mmpg.bench.memory`), variants interleaved
over rounds (`mmpg.bench.runner`); each row shows the ceilings of `mmpg.bench.flops` beside the measured speed-up.
Prompts come from `mmpg.bench.batch`, tables and JSON from `mmpg.bench.tables`.
Apart from the levels: `python -m mmpg.bench.sdpa_kernels` lists the SDPA kernels the sdpa backend's masked path
runs with the GQA K/V copy and with `enable_gqa`; `python -m mmpg.bench.inspector` times the inspector (app/) on a
large synthetic run (`mmpg.bench.inspector_run`).
"""

from mmpg.bench.flops import paper_reduction, rho_attn, rho_flops, rho_lin, step_flops

__all__ = ["paper_reduction", "rho_attn", "rho_flops", "rho_lin", "step_flops"]
