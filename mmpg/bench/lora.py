"""`mmpg bench --levels lora`: what LoRA saves in memory, measured on one whole GRPO step of the step level.

    variant      trains                                       KL reference
    full+copy    every language-model weight (vision frozen)  a frozen deep copy of the model (the trainer today)
    lora+copy    LoRA r on the LM's q,k,v,o,gate,up,down       a frozen deep copy of the base
    lora+off     the same adapters                             the policy with its adapters disabled: no copy

Each variant runs in a fresh process (`python -m mmpg.bench.lora CASE.json RESULT.json`, the step level's
`mmpg.bench.step.setup` with case lora_r / ref). Columns:

    trainable   parameters with requires_grad
    optim_MB    AdamW's state after the step (exp_avg, exp_avg_sq, step), exact tensor bytes
    ref_MB      the reference copy's tensors, exact bytes (0 when the adapters are switched off instead)
    setup_MB    memory in use after building model, reference and DeepSpeed engine, minus before (libraries
                imported first): RSS on the CPU, allocated bytes on a GPU
    step_MB     the cold step's high-water minus the memory in use at its start (activations, gradients and the
                allocation of the optimizer state; `mmpg.bench.step.PhaseClock`)
    peak_MB     setup_MB + step_MB: the training process's peak above its libraries

A program that prints a table and writes JSON, never a test of speed or size.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"full+copy": (False, "copy"), "lora+copy": (True, "copy"), "lora+off": (True, "adapters_off")}
MB = 2 ** 20


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (DeepSpeed wrappers unwrapped)."""
    import torch

    seen, total, todo = set(), 0, [optimizer]
    while todo:
        opt = todo.pop()
        if id(opt) in seen or opt is None:
            continue
        seen.add(id(opt))
        todo.append(getattr(opt, "optimizer", None))
        for state in getattr(opt, "state", {}).values():
            for value in (state.values() if isinstance(state, dict) else ()):
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def _module_bytes(module) -> int:
    import torch

    if not isinstance(module, torch.nn.Module):
        return 0
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def measure(case: dict) -> dict:
    """One variant in this process: build (measured), one cold GRPO step (measured), sizes."""
    import torch

    import deepspeed  # noqa: F401 - imported before the first reading: libraries are not the model's memory
    import peft  # noqa: F401
    import mmpg.rl.grpo  # noqa: F401
    from mmpg.bench import memory as probes
    from mmpg.bench.step import setup

    device = torch.device(case.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    gc.collect()
    before = probes.in_use(device)
    _, runner, _ = setup(case, device)
    gc.collect()
    setup_bytes = probes.in_use(device) - before
    cold = runner(memory=True)
    grpo = runner.grpo
    ref = grpo.ref if case.get("ref", "copy") == "copy" else None
    return {"trainable": sum(p.numel() for p in grpo.policy.parameters() if p.requires_grad),
            "params": sum(p.numel() for n, p in grpo.policy.named_parameters() if "lora_" not in n),
            "optim_bytes": _state_bytes(grpo.engine.optimizer), "ref_bytes": _module_bytes(ref),
            "setup_bytes": setup_bytes, "step_bytes": cold["peak_bytes"]["total"], "mem_method": cold["mem_method"],
            "step_s": cold["seconds"]["total"]}


# (LM spec, P, S, G): the step level's CPU LM (cpu-targets), where activations outweigh the 11 MB of weights, and
# a wider LM of ~92M parameters with a short prompt, where the weights and their optimizer state dominate
SIZES = {
    "cpu": ({"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512},
            1024, 32, 4),
    "wide": ({"hidden_size": 1024, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 2816},
             256, 32, 4),
}


def cases(args) -> list[tuple[str, str, dict]]:
    """(size, variant, case): the three variants at each size (--P/--S/--G override the shape)."""
    from mmpg.bench.presets import step

    r = getattr(args, "lora_r", 16)
    out = []
    for size, (spec, *shape) in SIZES.items():
        P, S, G = (getattr(args, k)[0] if getattr(args, k, None) else d for k, d in zip(("P", "S", "G"), shape))
        base = {k: v for k, v in step(P, S, G, args.family, spec, variants=["mmpg"]).items() if k != "variants"}
        for name, (lora, ref) in VARIANTS.items():
            out.append((size, name, dict(base, variant="mmpg", lora_r=r if lora else 0, ref=ref)))
    return out


def _in_fresh_process(case: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-lora-") as tmp:
        src, dst = Path(tmp) / "case.json", Path(tmp) / "result.json"
        src.write_text(json.dumps(case))
        proc = subprocess.run([sys.executable, "-m", "mmpg.bench.lora", str(src), str(dst)], capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not dst.is_file():
            return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        return json.loads(dst.read_text())


def format_table(rows: list[dict]) -> str:
    head = f"{'size':<5} {'variant':<10} {'params':>7} {'trainable':>10} {'optim_MB':>9} {'ref_MB':>7} " \
           f"{'setup_MB':>9} {'step_MB':>8} {'peak_MB':>8} {'step_s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['size']:<5} {r['variant']:<10} error: {r['error']}")
            continue
        step = r["step_bytes"]
        peak = r["setup_bytes"] + step if step is not None else None
        cells = [f"{r['params'] / 1e6:>6.1f}M", f"{r['trainable']:>10,}", f"{r['optim_bytes'] / MB:>9.2f}",
                 f"{r['ref_bytes'] / MB:>7.2f}", f"{r['setup_bytes'] / MB:>9.1f}",
                 f"{step / MB:>8.1f}" if step is not None else f"{'n/a':>8}",
                 f"{peak / MB:>8.1f}" if peak is not None else f"{'n/a':>8}", f"{r['step_s']:>7.1f}"]
        lines.append(f"{r['size']:<5} {r['variant']:<10} " + " ".join(cells))
    return "\n".join(lines)


def run(args) -> int:
    """`mmpg bench --levels lora`: the variants at each size, one fresh process each; table on stdout, JSON."""
    from mmpg.bench import tables

    planned = cases(args)
    print(f"mmpg bench --levels lora (LoRA r {args.lora_r}, alpha 2r, on q,k,v,o,gate,up,down of the LM):")
    for size, _, case in planned[::len(VARIANTS)]:
        print(f"  {size}: {tables.describe_config(dict(case, variants=[]))}, P {case['P']}")
    rows = []
    for size, name, case in planned:
        print(f"  measuring {size} {name} ...", file=sys.stderr, flush=True)
        rows.append(dict(_in_fresh_process(case, args.timeout), size=size, variant=name, case=case))
    print(format_table(rows))
    env = tables.provenance()
    path = tables.write_json(args.out or tables.default_out_path(), rows,
                             {"level": "lora", "argv": sys.argv[1:], **env})
    print(f"wrote {path}")
    return 1 if any(r.get("error") for r in rows) else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m mmpg.bench.lora CASE.json RESULT.json", file=sys.stderr)
        return 2
    from mmpg.bench.tables import atomic_write

    atomic_write(argv[1], json.dumps(measure(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
