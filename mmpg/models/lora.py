"""LoRA on the language model, built with peft (`LoraConfig`, `get_peft_model`); `model.lora.r > 0` turns it on.

`get_peft_model` replaces each targeted `nn.Linear` in place by peft's `lora.Linear` wrapper (`base_layer` + `lora_A`
/ `lora_B`) and freezes every other parameter. The policy mmpg hands around stays the transformers model itself
(Qwen2_5_VLForConditionalGeneration, ...); the `PeftModel` shell is kept beside it (`peft_model(policy)`) for what
only it does: switching the adapters off and `save_pretrained` in peft's format. So nothing needs unwrapping:
  * a LoRA wrapper only changes what a q/k/v projection returns, so the grouped attention (registered on the inner
    text model's config), the HF rollout engine and the repeated reference run through it unchanged, and
    `model.model` and `model.config.model_type` still find the Qwen model (a `PeftModel`'s `.model` would not);
  * only adapter tensors require grad, so the DeepSpeed engine's optimizer holds only them; under ZeRO-3 the frozen
    base is partitioned like any parameter and gathered per module in each forward.
The KL reference with LoRA is the same model with its adapters off (`reference_model`): peft's `disable_adapter()`
makes each wrapper return `base_layer(x)`, the base checkpoint's forward, and every rank switches at the same point
of the same lockstep loop, so the ZeRO-3 gathers are the same on every rank.

Target modules (`resolve_targets`): a leaf name (q_proj) matches inside the language model only, a dotted name as a
suffix of the full module name anywhere; peft gets the list of full module names, so its own suffix matching cannot
catch the vision tower's modules of the same leaf name (Qwen2.5-VL's blocks have mlp.gate_proj / up_proj too).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from mmpg.errors import UserError

@dataclasses.dataclass
class LoraHandle:
    """What `apply_lora` leaves on the policy (`policy.mmpg_lora`): the peft shell and what was adapted."""

    peft: object  # peft.PeftModel whose base_model.model is the policy
    targets: list[str]  # full module names that got adapters
    base: str  # base checkpoint: absolute local path, or a hub id (adapter_config.json's base_model_name_or_path)


def _named_prefix(model, sub) -> str | None:
    """The module name of `sub` inside `model` ('model.language_model'), or None."""
    if sub is None:
        return None
    return next((name for name, m in model.named_modules() if m is sub), None)


def model_parts(model) -> tuple[str, str | None]:
    """(language model prefix, vision tower prefix or None) as module-name prefixes ending in '.'."""
    inner = getattr(model, "model", None)
    text = _named_prefix(model, getattr(inner, "language_model", None)) or _named_prefix(model, inner)
    vision = _named_prefix(model, getattr(inner, "visual", None))
    if text is None:
        raise UserError(f"model.lora: cannot find the language model inside {type(model).__name__}")
    return text + ".", (vision + ".") if vision else None


def _adaptable(module) -> bool:
    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d))


def resolve_targets(model, entries: list[str], freeze_vision: bool) -> list[str]:
    """Full names of the modules `entries` (model.lora.target_modules) name; one UserError line for an entry that
    matches nothing or for a vision module while model.freeze_vision is on."""
    text, vision = model_parts(model)
    names = [n for n, m in model.named_modules() if n and _adaptable(m)]
    found: list[str] = []
    for entry in entries:
        entry = entry.strip(". ")
        if "." in entry:
            hits = [n for n in names if n == entry or n.endswith("." + entry)]
        else:
            hits = [n for n in names if n.startswith(text) and n.rsplit(".", 1)[-1] == entry]
        if not hits:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n.startswith(text)})
            raise UserError(f"model.lora.target_modules: {entry!r} matches no module of the "
                            f"{model.config.model_type} model; leaf names in its language model: "
                            f"{', '.join(leaves)} (a dotted name is matched as a suffix of full module names)")
        on_vision = [n for n in hits if vision and n.startswith(vision)]
        if on_vision and freeze_vision:
            raise UserError(f"model.lora.target_modules: {entry!r} names vision-tower modules ({on_vision[0]}, ...) "
                            "while model.freeze_vision is true; set model.freeze_vision=false to adapt the vision "
                            "tower, or name language-model modules only")
        found += [n for n in hits if n not in found]
    return found


def base_reference(path: str | Path) -> str:
    """`path` as adapter_config.json's base_model_name_or_path: an existing folder's absolute path, else the hub id
    (`mmpg.models.loading.resolve_checkpoint` has already checked that it is one)."""
    local = Path(str(path)).expanduser()
    return str(local.resolve()) if local.exists() else str(path)


def apply_lora(model, lora_cfg, base_path: str | Path, freeze_vision: bool, seed: int = 0):
    """Adapters on `model` in place (peft); returns the same model, with `model.mmpg_lora` set. lora_cfg:
    mmpg.config.LoraConfig with r > 0. peft draws lora_A from the global torch RNG (lora_B starts at 0); that draw
    is seeded with `seed` (trainer.seed) in a forked RNG, so two runs start from the same adapters and the caller's
    RNG stream is left as it was."""
    from peft import LoraConfig, get_peft_model

    targets = resolve_targets(model, list(lora_cfg.target_modules), freeze_vision)
    base = base_reference(base_path)
    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=targets, bias="none", base_model_name_or_path=base)
    # adapters in the base's dtype (DeepSpeed's bf16 mode casts every trainable tensor to bf16 anyway)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        shell = get_peft_model(model, config, autocast_adapter_dtype=False)
    shell.peft_config["default"].base_model_name_or_path = base
    assert shell.base_model.model is model  # injected in place: the policy stays the transformers model
    object.__setattr__(model, "mmpg_lora", LoraHandle(peft=shell, targets=targets, base=base))
    return model


def resume_mismatch(policy, adapter_config: dict) -> str | None:
    """What differs between a checkpoint's adapter_config.json and this run's adapters (r, alpha, the adapted
    modules, the base), or None: resuming onto other adapters would load some tensors and leave others fresh."""
    c = lora_handle(policy).peft.peft_config["default"]
    ours = {"r": c.r, "lora_alpha": c.lora_alpha, "target_modules": sorted(c.target_modules),
            "base_model_name_or_path": c.base_model_name_or_path}
    theirs = {k: adapter_config.get(k) for k in ours}
    theirs["target_modules"] = sorted(theirs["target_modules"] or [])
    differ = []
    for k in ours:
        if theirs[k] == ours[k]:
            continue
        if k == "target_modules":
            only = sorted(set(theirs[k]) ^ set(ours[k]))
            differ.append(f"target_modules: {len(theirs[k])} there, {len(ours[k])} here, e.g. {only[0]}")
        else:
            differ.append(f"{k} {theirs[k]!r} there, {ours[k]!r} here")
    return "; ".join(differ) or None


def lora_handle(policy) -> LoraHandle | None:
    return getattr(policy, "mmpg_lora", None)


def is_lora(policy) -> bool:
    return lora_handle(policy) is not None


@contextlib.contextmanager
def without_dropout(policy):
    """The adapters' dropout off for a `with` block, restored after (also on an error). model.lora.dropout applies
    to the update's forward only: the rollout runs in eval mode, and the passes that must be deterministic — the
    self-check (grouped vs repeated, two forwards that would draw different masks), the old and the reference
    logprobs — run without it. A no-op without LoRA or with dropout 0."""
    handle = lora_handle(policy)
    drops = [m for name, m in policy.named_modules() if ".lora_dropout." in f".{name}." and m.training] \
        if handle is not None else []
    for m in drops:
        m.eval()
    try:
        yield policy
    finally:
        for m in drops:
            m.train()


@contextlib.contextmanager
def reference_model(policy, ref=None):
    """The KL reference for a `with` block: `ref` when a separate one is loaded, else (LoRA) the policy with its
    adapters off, switched back on when the block ends (also on an error)."""
    handle = lora_handle(policy)
    if ref is not None or handle is None:
        if ref is None:
            raise RuntimeError("no reference model: algorithm.beta > 0 needs model.ref_path or LoRA")
        yield ref
        return
    with handle.peft.disable_adapter():
        yield policy


def separate_reference(model_cfg) -> str | None:
    """The folder to load as the KL reference, or None when the LoRA policy's adapters-off forward is the
    reference (model.ref_path empty or the same checkpoint as model.path)."""
    ref = model_cfg.ref_path or model_cfg.path
    if model_cfg.lora.r == 0:
        return ref
    if not model_cfg.ref_path or base_reference(model_cfg.ref_path) == base_reference(model_cfg.path):
        return None
    return model_cfg.ref_path


def adapter_parameters(policy) -> list[tuple[str, torch.nn.Parameter]]:
    """(name in peft's state dict, parameter) of every adapter tensor: 'base_model.model.<module>.lora_A.default.weight'
    (the names `PeftModel.save_pretrained` expects in its `state_dict`)."""
    handle = lora_handle(policy)
    return [(f"base_model.model.{n}", p) for n, p in policy.named_parameters() if "lora_" in n] if handle else []


def save_adapter(policy, folder: Path, state_dict: dict) -> None:
    """adapter_config.json + adapter_model.safetensors in `folder` (peft's format) from the gathered adapter
    tensors `state_dict` (keyed as `adapter_parameters`). The base is named by its absolute path or hub id."""
    handle = lora_handle(policy)
    handle.peft.peft_config["default"].base_model_name_or_path = handle.base
    handle.peft.save_pretrained(str(folder), state_dict=state_dict, safe_serialization=True,
                                save_embedding_layers=False)


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 keeps the full size in ds_numel


def trainable_summary(model) -> dict:
    """{"trainable", "total", "text", "lora": {r, alpha, dropout, modules} or None} for the run header and run.json."""
    total = sum(_numel(p) for p in model.parameters())
    trainable = sum(_numel(p) for p in model.parameters() if p.requires_grad)
    handle = lora_handle(model)
    lora = None
    if handle is not None:
        c = handle.peft.peft_config["default"]
        lora = {"r": c.r, "alpha": c.lora_alpha, "dropout": c.lora_dropout, "modules": len(handle.targets)}
    share = 100.0 * trainable / max(1, total)
    share_text = f"{share:.1f}" if share >= 1 else f"{share:.2g}"
    text = f"trainable parameters: {_count(trainable)} of {_count(total)} ({share_text} %)"
    if lora:
        text += f", LoRA r={lora['r']} on {lora['modules']} modules"
    return {"trainable": trainable, "total": total, "text": text, "lora": lora}


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
