"""Loading policies and processors the way a real checkpoint is loaded (`from_pretrained`), tiny or not.

`path` is a local checkpoint folder, or a hub id already in the local Hugging Face cache (`resolve_checkpoint`,
which then hands transformers the hub id as usual). A path that is neither is refused at once with one line naming
it, instead of a download attempt."""

from __future__ import annotations

import logging
import os
import re
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


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # `name` or `owner/name`


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config.json (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the hub library refuses is not in its cache either
        return False


def resolve_checkpoint(path: str | Path) -> str:
    """What to hand `from_pretrained` for `path`, decided here at once and without the network.

    An existing local folder must hold config.json. Otherwise `path` must be a hub id (`owner/name`) already in the
    local Hugging Face cache. Anything else is refused: transformers would take a missing relative folder such as
    `models/q25` for a hub id (it has one slash) and retry the download for ~25 s before failing with "couldn't
    connect to huggingface.co"."""
    text = str(path)
    local = Path(text).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise UserError(f"{text}: no config.json here; point at a checkpoint folder (mmpg make-tiny builds one)")
        return str(local)
    if not _HUB_ID.match(text) or ".." in text:
        raise UserError(f"no checkpoint folder at {text}; point at a local checkpoint folder "
                        "(mmpg make-tiny builds one)")
    if not _in_hub_cache(text):
        raise UserError(f"no checkpoint folder at {text}, and {text} is not a model in the local Hugging Face cache; "
                        f"give a local checkpoint folder, or download it first with `huggingface-cli download {text}`")
    return text


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

    config = model.config
    text = getattr(getattr(config, "text_config", None), "_attn_implementation", None) or config._attn_implementation
    vision = getattr(getattr(config, "vision_config", None), "_attn_implementation", None)
    dtype = model.get_input_embeddings().weight.dtype
    grouped = resolve_backend(getattr(model, "_mmpg_backend", "auto"), torch.device(device), dtype)
    return f"model {text}{f' (vision tower {vision})' if vision and vision != text else ''}, grouped forward {grouped}"


def load_policy(path: str | Path, dtype: str | torch.dtype = "float32", attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, freeze_vision: bool = False, device: str | None = None,
                lora=None, seed: int = 0):
    """A Qwen-VL (or text-only Qwen) policy from `path`, with the given dtype and attention implementation
    (`resolve_attn_implementation`: "auto", or flash_attention_2 falling back to sdpa where flash-attn cannot run).

    freeze_vision: no gradients for the vision tower (common for grounding RL); the grouped forward then still runs
    it once per prompt, under no_grad. Qwen2.5-VL comes with the mRoPE convention its checkpoints were trained with
    (`mmpg.grouping.positions`), also for `generate`. lora: a `mmpg.config.LoraConfig`; with r > 0 the model gets
    peft LoRA adapters in place and only they train (`mmpg.models.lora`), lora_A drawn with `seed`."""
    path = resolve_checkpoint(path)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    attn_implementation = resolve_attn_implementation(attn_implementation, device)
    model = auto.from_pretrained(path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation)
    if device is not None:
        model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if freeze_vision and hasattr(model, "model") and hasattr(model.model, "visual"):
        model.model.visual.requires_grad_(False)
    from mmpg.grouping.positions import use_qwen_positions

    model = use_qwen_positions(model)
    if lora is not None and lora.r > 0:
        from mmpg.models.lora import apply_lora

        apply_lora(model, lora, path, freeze_vision, seed=seed)
    return model


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
