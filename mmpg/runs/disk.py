"""What a checkpoint occupies on disk, from parameter counts alone, and the free-space check a save makes first.

N parameters (N_t trained, F = N - N_t frozen), b bytes per weight value (2 in bfloat16, 4 in float32), W ranks.
What `mmpg.train.checkpoint.save_checkpoint` writes, as DeepSpeed 0.19 and `save_pretrained` lay it out:

    weights      b·N            model.safetensors (LoRA: the adapter, b·N_t)                  every checkpoint
    processor    ~11.4 MB       tokenizer.json and configs (Qwen2.5-VL's and Qwen3-VL's, re-saved)
    rng, state   ~16 kB a rank  rng/rank_*.pt, trainer_state.json, schedule.json, COMPLETE
    module       b·N            deepspeed/state/*model_states.pt: the module again (ZeRO 0-2; LoRA: b·N_t)
                 + b·F          ZeRO-2 on a GPU: the frozen tensors once more (`frozen_param_fragments`, CPU copies;
                                on a CPU they share the module's storage and torch.save writes them once)
                 b·F            ZeRO-3: the frozen tensors' partitions only (trained ones live in the optimizer files)
    optimizer    8·N_t          AdamW's m and v (fp32)                                          optimizer state only
                 + 4·N_t        the fp32 master copy (bfloat16 training, or any ZeRO stage >= 1); ZeRO 0 writes it
                                into the model_states file, ZeRO 1-3 into zero_pp_rank_*_optim_states.pt, 1/W a rank

A weights-only checkpoint (`checkpoint.optimizer_state`) holds weights, processor and the small files; one with
optimizer state holds all of it (Qwen2.5-VL-7B, bfloat16, ZeRO-2, tower frozen: 118.3 GB against 15.5 GB, GB = 2^30
bytes as `mmpg plan` prints them). `tests/test_checkpoint_disk.py` checks each part against the files a CPU run
writes under ZeRO 0-3; the GPU-only term (ZeRO-2's frozen copies) is read from DeepSpeed's `_save_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

PROCESSOR_BYTES = 11_430_000  # Qwen2.5-VL's and Qwen3-VL's processors re-saved: tokenizer.json 11.42 MB + configs
RANK_BYTES = 16 * 1024  # rng/rank_*.pt (15.7 kB measured)
SMALL_BYTES = 64 * 1024  # config.json, generation_config.json, trainer_state.json, schedule.json, COMPLETE
DS_SCRIPTS = 41_070  # zero_to_fp32.py + zero_to_torch.py, which DeepSpeed copies in from ZeRO-1 on
PICKLE_SLACK = 0.01  # torch.save's pickled names and metadata beyond the tensor bytes (a few % on tiny models)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Bytes of one checkpoint by part; `full` with the optimizer state (deepspeed/), `weights_only` without."""

    weights: int
    processor: int
    small: int
    module: int
    master: int
    moments: int

    @property
    def weights_only(self) -> int:
        return self.weights + self.processor + self.small

    @property
    def deepspeed(self) -> int:
        return self.module + self.master + self.moments

    @property
    def full(self) -> int:
        return self.weights_only + self.deepspeed


def checkpoint_sizes(n: int, trained: int, b: int, zero: int, world: int = 1, lora: bool = False,
                     gpu: bool = True, processor: int = PROCESSOR_BYTES) -> Sizes:
    """The parts of one checkpoint (the module docstring's table). `b`: bytes per weight value as trained (the
    master copy is fp32 whenever b < 4)."""
    frozen = 0 if lora else n - trained  # LoRA: the frozen base is not saved at all (exclude_frozen_parameters)
    if zero >= 3:
        module = b * frozen
    else:
        module = b * (trained if lora else n) + (b * frozen if zero == 2 and gpu else 0)
    master = 4 * trained if (b < 4 or zero >= 1) else 0
    moments = 8 * trained
    slack = 1 + PICKLE_SLACK
    return Sizes(weights=b * (trained if lora else n), processor=processor,
                 small=SMALL_BYTES + RANK_BYTES * world + (DS_SCRIPTS if zero >= 1 else 0),
                 module=int(module * slack), master=int(master * slack), moments=int(moments * slack))


def saves_in_run(total_steps: int, every: int) -> int:
    """Checkpoints a run writes: every `every` steps and at the end (every 0: only at the end)."""
    if every <= 0:
        return 1
    return total_steps // every + (1 if total_steps % every else 0)


def run_disk(sizes: Sizes, keep_last: int, policy: str, saves: int) -> dict:
    """{"kept": checkpoints on disk at the end, "steady_bytes": what they hold, "peak_bytes": the most on disk at any
    moment (a save is written beside the kept ones; pruning and, with `last`, the previous one's optimizer files go
    only once it is complete)}. `policy`: checkpoint.optimizer_state (last, all, none)."""
    full, light = sizes.full, sizes.weights_only

    def on_disk(count: int) -> int:  # `count` complete checkpoints, pruned and stripped
        if count <= 0:
            return 0
        if policy == "last":  # only the newest still holds its optimizer state
            return full + (count - 1) * light
        return count * (light if policy == "none" else full)

    peak = kept = 0
    for s in range(1, saves + 1):
        before = min(keep_last, s - 1) if keep_last > 0 else s - 1  # complete checkpoints on disk during save s
        peak = max(peak, on_disk(before) + (light if policy == "none" else full))
        kept = min(keep_last, s) if keep_last > 0 else s
    steady = on_disk(kept)
    return {"kept": kept, "steady_bytes": steady, "peak_bytes": peak}


def free_bytes(folder: Path) -> tuple[int, Path]:
    """(free bytes for an unprivileged writer, the existing folder measured) of the filesystem `folder` will be on."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe


def gb(x: float) -> str:
    return f"{x / 2 ** 30:.1f} GB" if x >= 2 ** 30 / 10 else f"{x / 2 ** 20:.1f} MB"


def space_problem(needed: int, folder: Path, what: str) -> str | None:
    """One line when `needed` bytes do not fit the free space where `folder` goes, else None."""
    free, where = free_bytes(folder)
    if needed <= free:
        return None
    return (f"{what} needs {gb(needed)}; {where} has {gb(free)} free. Free space there, lower checkpoint.keep_last, "
            "or keep the optimizer state in fewer checkpoints (checkpoint.optimizer_state=last or none)")


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total
