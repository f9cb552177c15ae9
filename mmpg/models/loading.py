"""Loading policies and processors the way a real checkpoint is loaded (`from_pretrained`), tiny or not.

`path` is a local checkpoint folder, or a hub id (`owner/name`): its snapshot in the Hugging Face cache, downloaded
once per node when the cache lacks it (`mmpg.models.hub`), is what transformers loads. A path that is neither is
refused at once with one line naming it."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from mmpg.errors import UserError

log = logging.getLogger("mmpg.models")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_checkpoint(path: str | Path) -> str:
    """The local folder to hand `from_pretrained` for `path` (`mmpg.models.hub.resolve_model`): an existing folder
    with config.json, or a hub id's cached snapshot (downloaded first where needed; once per process). Anything else
    is one UserError line: transformers would take a missing relative folder such as `models/q25` for a hub id (it
    has one slash) and retry the download for ~25 s before failing with "couldn't connect to huggingface.co"."""
    from mmpg.models.hub import resolve_model

    return resolve_model(path).folder


def load_processor(path: str | Path):
    """The checkpoint's processor (VL families) or tokenizer (text families)."""
    path = resolve_checkpoint(path)
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "vision_config"):
        return AutoProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _flash_attn_missing(device: str | None) -> str | None:
    """Why transformers' flash_attention_2 cannot run for a model on `device` (None: it can)."""
    on_cuda = str(device).startswith("cuda") if device is not None else torch.cuda.is_available()
    if not on_cuda:
        return f"the model runs on {device or 'the CPU'}"
    try:
        import flash_attn  # noqa: F401 - a build for another torch fails here, not at find_spec
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken build's OSError / RuntimeError
        return f"flash-attn does not import ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return f"transformers cannot use flash-attn {getattr(flash_attn, '__version__', '(no version)')}"
    return None


def resolve_attn_implementation(name: str, device: str | None = None) -> str:
    """The transformers attention to load with. "auto": flash_attention_2 on CUDA when flash-attn imports, else sdpa.
    "flash_attention_2" where flash-attn cannot run: sdpa, with a warning (the same results, more memory and time;
    scripts/env.sh skips flash-attn on machines that cannot build it). Any other name is kept."""
    if name not in ("auto", "flash_attention_2"):
        return name
    why = _flash_attn_missing(device)
    if why is None:
        return "flash_attention_2"
    if name == "flash_attention_2":
        log.warning("model.attn_implementation=flash_attention_2, but %s: loading with sdpa instead (same results, "
                    "more memory); model.attn_implementation=auto picks it without this warning", why)
    return "sdpa"


def attention_summary(model, device: str) -> str:
    """What each attention path of a loaded policy runs on, for the run header: the model's own forwards
    (generation, the vision tower) and the grouped forward's backend (`mmpg.grouping.backends.resolve_backend`)."""
    from mmpg.grouping.backends import resolve_backend
    from mmpg.grouping.patch import grouping_state

    config = model.config
    text = getattr(getattr(config, "text_config", None), "_attn_implementation", None) or config._attn_implementation
    vision = getattr(getattr(config, "vision_config", None), "_attn_implementation", None)
    dtype = model.get_input_embeddings().weight.dtype
    grouped = resolve_backend(grouping_state(model).backend, torch.device(device), dtype)
    return f"model {text}{f' (vision tower {vision})' if vision and vision != text else ''}, grouped forward {grouped}"


def load_policy(path: str | Path, dtype: str | torch.dtype = "float32", attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, freeze_vision: bool = False, device: str | None = None,
                lora=None, seed: int = 0, train_merger: bool = False):
    """A Qwen-VL (or text-only Qwen) policy from `path`, with the given dtype and attention implementation
    (`resolve_attn_implementation`: "auto", or flash_attention_2 falling back to sdpa where flash-attn cannot run).

    freeze_vision: no gradients for the vision tower (common for grounding RL); the grouped forward then still runs
    it once per prompt, under no_grad; with train_merger, for all of it but its patch merger (`visual.merger`), where
    autograd starts recording. Qwen2.5-VL comes with the mRoPE convention its checkpoints were trained with
    (`mmpg.grouping.positions`), also for `generate`. lora: a `mmpg.config.LoraConfig`; with r > 0 the model gets
    peft LoRA adapters in place and only they train (`mmpg.models.lora`), lora_A drawn with `seed`."""
    given, path = path, resolve_checkpoint(path)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    attn_implementation = resolve_attn_implementation(attn_implementation, device)
    # use_kernels=False: from transformers 5.25 (which requires the `kernels` package) from_pretrained swaps layers
    # for hub kernels by default (RMSNorm, the rotary embedding, apply_rotary_pos_emb in Qwen-VL); a swapped layer
    # is code the grouped forward's equivalence tests never ran, fetched from the hub. Every version mmpg supports
    # (>= 5.17) takes the keyword (5.17-5.24: default False).
    model = auto.from_pretrained(path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation,
                                 use_kernels=False)
    if device is not None:
        model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if freeze_vision and hasattr(model, "model") and hasattr(model.model, "visual"):
        model.model.visual.requires_grad_(False)
        if train_merger:
            model.model.visual.merger.requires_grad_(True)
    from mmpg.grouping.positions import use_qwen_positions

    model = use_qwen_positions(model)
    if lora is not None and lora.r > 0:
        from mmpg.models.lora import apply_lora

        apply_lora(model, lora, given, freeze_vision, seed=seed)  # the hub id, not this node's cache folder
    if gradient_checkpointing:
        checkpoint_in_eval_mode(model)
    return model


def checkpoint_in_eval_mode(model) -> int:
    """Make gradient checkpointing act on a model that stays in eval mode; returns the layers switched.

    transformers checkpoints a layer only while `layer.training` (GradientCheckpointingLayer), and mmpg trains
    the policy in eval mode (from_pretrained's): no dropout anywhere, so the update's ratio, the self-check's two
    forwards and the reference agree exactly. In eval mode `model.gradient_checkpointing=true` did nothing: every
    layer's activations were kept (a tiny naive run's update: 1.0 GB where its plan, which counts checkpointing,
    says 0.4 GB). Only the checkpointed layers are flagged as training: their own forward reads no other flag;
    their attention, MLP and norms (where dropout lives) stay in eval mode. A later `model.train()` / `.eval()`
    resets the flags with everything else."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.training = True
    return len(layers)


def save_model_folder(out: str | Path, model, processor, extra: dict[str, str] | None = None) -> Path:
    """Write model + processor (and `extra` files, name -> text) as an HF checkpoint folder `out`, atomically: into a
    temp folder beside it, renamed into place only when complete (a previous `out` is replaced; the caller checks
    that replacing it is wanted). Weights as safetensors."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
