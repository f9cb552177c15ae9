"""LoRA checkpoints as plain models: load an adapter checkpoint on its base, merge it, export it, sync it to vLLM.

An adapter checkpoint is a folder holding peft's `adapter_config.json` + `adapter_model.safetensors`
(`base_model_name_or_path` names the base checkpoint), usually the processor files too. Merging replaces each
adapted linear's weight by

    W' = W + scale · B @ A          scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA), computed by peft's own
                                    `get_delta_weight`, so the sync merges as `merge_and_unload` does

and drops the adapter: the result is the base architecture with other weights, loaded like any checkpoint.

    model = load_adapter_model("runs/x/checkpoints/step_00000040")        # base + adapter, merged
    export_checkpoint("runs/x/checkpoints/step_00000040", "exports/x-40")  # = `mmpg export`
    tensors = sync_tensors(policy)       # {plain HF name: merged weight} of what a step changed (the vLLM sync)
    tensors = gathered_sync_tensors(policy, keep=rank == 0)   # the same under ZeRO-3 (collective, piece by piece)

Names: a peft-wrapped policy names its parameters `base_model.model.<hf name>` with `.base_layer.` inside adapted
linears, `lora_A.<adapter>` / `lora_B.<adapter>` beside it and `.modules_to_save.<adapter>.` for fully trained
copies; `hf_name` maps them back to the plain model's names (those the vLLM server loads).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from mmpg.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
EXPORT_INFO = "mmpg_export.json"  # what an export was made from (ignored by from_pretrained and vLLM)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


def is_adapter_checkpoint(path) -> bool:
    """Whether `path` is a folder holding a peft adapter (adapter_config.json)."""
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_base(path) -> str:
    """What to hand `from_pretrained` for the adapter's base (`base_model_name_or_path`); one UserError line naming
    the adapter folder, the base it asks for and what to do when the base is not there."""
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{folder / ADAPTER_CONFIG}: cannot read the adapter's config ({e})") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise UserError(f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path; set it to the base "
                        "checkpoint the adapter was trained on")
    from mmpg.models.loading import resolve_checkpoint

    hint = (f"put the base checkpoint back at that path, or set base_model_name_or_path in "
            f"{folder / ADAPTER_CONFIG} to where it is now")
    local = Path(base).expanduser()
    if local.is_absolute() or base.startswith(("./", "../", "~")) or local.exists():
        if not (local / "config.json").is_file():
            raise UserError(f"LoRA adapter {folder}: its base model {base} is missing (no config.json there); {hint}")
        return str(local)
    try:
        return resolve_checkpoint(base)
    except UserError as e:
        raise UserError(f"LoRA adapter {folder}: its base model {base} is missing ({e}); {hint}") from None


def load_adapter_model(path, dtype="float32", device: str | None = None, merge: bool = True,
                       attn_implementation: str = "sdpa"):
    """The base of the adapter checkpoint at `path` (`load_policy`) with the adapter loaded on it (peft
    `PeftModel.from_pretrained`, frozen); merged into a plain model unless merge=False (then the PeftModel)."""
    from peft import PeftModel

    from mmpg.models.loading import load_policy

    base = adapter_base(path)
    model = load_policy(base, dtype=dtype, attn_implementation=attn_implementation, device=device)
    try:
        model = PeftModel.from_pretrained(model, str(Path(path).expanduser()), is_trainable=False)
    except Exception as e:  # noqa: BLE001 - a damaged adapter file, or an adapter of another base
        raise UserError(f"LoRA adapter {path}: cannot load it on its base {base} ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None
    return merged_model(model) if merge else model


def merged_model(model):
    """A PeftModel (or a model with LoRA layers injected) -> the plain model with every adapter merged into its
    weights (peft `merge_and_unload`; the PeftModel is consumed). Any other model is returned unchanged."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    if not has_lora(model):
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):  # injected without a PeftModel around it
        if isinstance(module, BaseTunerLayer) and hasattr(module, "base_layer"):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model


def load_any_processor(path):
    """The processor saved in the checkpoint folder, else (an adapter folder without one) its base's."""
    from mmpg.models.loading import load_processor

    folder = Path(path).expanduser()
    if not is_adapter_checkpoint(folder):
        return load_processor(folder)
    if any((folder / name).is_file() for name in PROCESSOR_FILES):
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        config = AutoConfig.from_pretrained(adapter_base(folder))
        return (AutoProcessor if hasattr(config, "vision_config") else AutoTokenizer).from_pretrained(str(folder))
    return load_processor(adapter_base(folder))


# ---- export ----------------------------------------------------------------------------------------------------------
def checkpoint_dtype(path) -> str:
    """The dtype a checkpoint's config.json states (`dtype`, or `torch_dtype` in older files), float32 if none."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for where in (config, text):
        value = where.get("dtype") or where.get("torch_dtype")
        if isinstance(value, str):
            return value
    return "float32"


def export_checkpoint(checkpoint, out, dtype: str = "auto", overwrite: bool = False) -> dict:
    """Write `checkpoint` as a plain HF model folder `out`: an adapter checkpoint merged into its base, a full-weight
    one re-saved without the trainer and DeepSpeed state. safetensors weights, config, generation config, processor
    files, and EXPORT_INFO. Atomic: written into a temp folder beside `out`, then renamed. dtype "auto": the base's.
    Returns EXPORT_INFO's content."""
    from mmpg.models.loading import load_policy, resolve_checkpoint, resolve_dtype, save_model_folder

    src = Path(checkpoint).expanduser()
    adapter = is_adapter_checkpoint(src)
    base = adapter_base(src) if adapter else resolve_checkpoint(src)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"{out} exists and is not empty; pass --overwrite or choose another --out")
    for keep in (src, Path(base)):  # --overwrite replaces --out whole: never a folder holding what it reads
        if keep.exists() and (out.resolve() == keep.resolve() or out.resolve() in keep.resolve().parents):
            raise UserError(f"--out {out} is or holds {keep}, which the export reads; choose another folder")
    dtype = checkpoint_dtype(base) if dtype == "auto" else dtype
    resolve_dtype(dtype)  # an unknown name: one line, before any loading
    model = load_adapter_model(src, dtype=dtype) if adapter else load_policy(base, dtype=dtype)
    processor = load_any_processor(src)
    info = {"source": str(src.resolve()), "base": str(Path(base).resolve()) if Path(base).exists() else base,
            "adapter_merged": adapter, "dtype": dtype}
    save_model_folder(out, model, processor, {EXPORT_INFO: json.dumps(info, indent=2) + "\n"})
    return info


# ---- weight sync -----------------------------------------------------------------------------------------------------
_WRAPPER = re.compile(r"(^|\.)base_model\.model\.")  # PeftModel -> LoraModel -> the wrapped model
_ADAPTER_PART = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)")


def hf_name(name: str) -> str | None:
    """A peft-wrapped policy's parameter name -> the plain model's; None for adapter-only tensors (lora_A/B, the
    frozen original of a modules_to_save copy)."""
    if _ADAPTER_PART.search(name) or ".original_module." in name:
        return None
    name = _WRAPPER.sub(r"\1", name)
    name = name.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def _is_lora_layer(module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return isinstance(module, LoraLayer)


def has_lora(model) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


def _merged_weight(module) -> torch.Tensor:
    """W + sum of the active, not yet merged adapters' deltas (peft's own `get_delta_weight`), in W's dtype."""
    weight = module.get_base_layer().weight.detach()
    if getattr(module, "disable_adapters", False):
        return weight
    out = weight
    for name in module.active_adapters:
        owned = name in module.lora_A or name in getattr(module, "lora_embedding_A", {})
        if owned and name not in getattr(module, "merged_adapters", ()):
            out = out + module.get_delta_weight(name).to(weight.dtype)
    return out


class SyncItem(NamedTuple):
    """One tensor of the sync: `value()` is its content once every parameter in `reads` is whole."""
    name: str  # the plain model's name (what the server loads)
    reads: tuple  # the parameters it is computed from: one, or every parameter of a LoRA layer (its merge)
    value: Callable[[], torch.Tensor]


def sync_items(model, everything: bool = False) -> list[SyncItem]:
    """What `sync_tensors` sends, in the model's parameter order, each with the parameters it reads. Decided from
    names, `requires_grad` and module types only, so it needs no parameter's content (ZeRO-3 shards may be empty);
    a DoRA adapter is refused here, on every rank, before anything is gathered."""
    if not has_lora(model):
        return [SyncItem(n, (p,), p.detach) for n, p in model.named_parameters() if everything or p.requires_grad]
    merged = {n: m for n, m in model.named_modules() if _is_lora_layer(m)}
    for module in merged.values():
        if not getattr(module, "disable_adapters", False) and any(getattr(module, "use_dora", {}).values()):
            raise UserError("LoRA with DoRA (use_dora) cannot be synced to vLLM as W + scale B A; use plain LoRA or "
                            "rollout.engine=hf")
    parents = {n.rpartition(".")[0] for n in merged}
    out, done = [], set()
    for name, p in model.named_parameters():
        plain = hf_name(name)
        if plain is None:
            continue
        owner = name.rpartition(".")[0].replace(".base_layer", "")
        parent = owner.rpartition(".")[0]
        if owner in merged and name.endswith(".base_layer.weight"):  # W -> W + scale B A, where W stood
            out.append(_merged_item(owner, merged[owner]))
            done.add(owner)
        elif everything or p.requires_grad or owner in merged or owner in parents or parent in parents:
            out.append(SyncItem(plain, (p,), p.detach))
    return out + [_merged_item(o, m) for o, m in merged.items() if o not in done]  # a W listed under a tied name


def _merged_item(owner: str, module) -> SyncItem:
    return SyncItem(hf_name(f"{owner}.weight"), tuple(module.parameters()), lambda: _merged_weight(module))


def sync_tensors(model, everything: bool = False) -> dict[str, torch.Tensor]:
    """{plain HF name: tensor} to send to a vLLM server serving the plain model (detached, on the model's device).

    Without LoRA: the trainable parameters (every parameter with `everything`), as named. With LoRA: every parameter
    of each module holding an adapted linear (its attention block or MLP), the adapted weights merged (`W + scale B A`),
    plus any other trainable tensor (a modules_to_save copy), under the plain model's names. Whole parent modules,
    not only the adapted weights: vLLM fuses q/k/v and gate/up into one layer, and its in-place reload needs every
    part of a fused layer (a part not sent would be left uninitialised, `mmpg.serve.worker_extension`). With
    `everything`: every tensor of the plain model, adapters merged (what a server that restarted from the base needs).
    A ZeRO-3 model (`is_partitioned`) holds only shards: use `gathered_sync_tensors`."""
    return {item.name: item.value() for item in sync_items(model, everything)}


# ---- weight sync under ZeRO-3 ----------------------------------------------------------------------------------------
PIECE_BYTES = 512 * 2 ** 20  # the most parameter bytes gathered at once (one tensor larger than this goes alone)


def is_partitioned(model) -> bool:
    """Whether DeepSpeed ZeRO-3 shards the model's parameters over the ranks (each rank holds a slice of each)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def sync_pieces(items: list[SyncItem], piece_bytes: int = PIECE_BYTES) -> list[list[SyncItem]]:
    """Consecutive items grouped so that the parameters a piece reads hold at most `piece_bytes` (whole sizes:
    `ds_numel` of a ZeRO-3 parameter), except one item larger than that alone. Model order: a piece is a few
    neighbouring modules (a LoRA layer's parameters always in one piece, its merge needs them together)."""
    pieces, size = [], 0
    for item in items:
        need = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in item.reads)
        if not pieces or size + need > piece_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(item)
        size += need
    return pieces


def gathered_sync_tensors(model, everything: bool = False, keep: bool = True, device="cpu",
                          piece_bytes: int = PIECE_BYTES) -> dict[str, torch.Tensor]:
    """`sync_tensors` of a ZeRO-3 model: a collective, every rank calls it with the same model and `everything`.

    Piece by piece (`sync_pieces`), every rank gathers the piece's parameters whole (`deepspeed.zero.
    GatheredParameters`, read only), the ranks with `keep` copy its tensors to `device` and the parameters go back
    to their shards: at most one piece is whole at a time besides what is kept. Returns {plain HF name: tensor}
    where `keep`, {} elsewhere (rank 0 keeps and sends; the others only take part in the gathers)."""
    import deepspeed

    out = {}
    with torch.no_grad():
        for piece in sync_pieces(sync_items(model, everything), piece_bytes):
            params = list({id(p): p for item in piece for p in item.reads}.values())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if keep:  # a copy: the gathered storage is freed when the parameters go back to their shards
                    out.update((item.name, item.value().to(device, copy=True)) for item in piece)
    return out
