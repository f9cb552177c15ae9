"""From a resolved config (`mmpg train --config CFG key=value ...`) and a device count to the `Recipe` one device
runs: its model geometry, dtype, ZeRO stage and sharding, LoRA, reference, the prompt's tokens, the micro-batch.

Prompt tokens: the video's LM tokens are the data budget's worst case (a video long enough to reach
data.max_frames), as qwen-vl-utils sizes it: min(max_frames / 2 · max_pixels, total_pixels) / (patch · merge)²,
the per-frame and whole-video defaults (256 tokens a frame, 8192 a video) where the config leaves them null; plus
TEXT_TOKENS of system prompt, template and question. `--video-tokens` / `--prompt-tokens` override both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mmpg.errors import UserError
from mmpg.models.geometry import Geometry, resolve
from mmpg.plan.memory import RUNTIME_BYTES, Recipe

TEXT_TOKENS = 120


def geometry_of(path: str) -> Geometry:
    """A folder with config.json, a hub id whose config.json is in the local HF cache, or a preset name."""
    hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if hub_id and not (Path(path).expanduser() / "config.json").is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            if isinstance(cached, str):
                return resolve(str(Path(cached).parent))
        except Exception:  # noqa: BLE001 - no cache, no hub package, a name it refuses: the presets decide
            pass
    if not path:
        from mmpg.models.geometry import MODELS

        raise UserError(f"model.path is empty: give model.path=FOLDER (with config.json) or a preset: "
                        f"{', '.join(MODELS)}")
    return resolve(path)


def video_tokens(cfg, g: Geometry) -> int:
    v = g.vision
    if v is None:
        return 0
    unit = (v.patch * v.merge) ** 2  # pixels per LM token per temporal patch
    per_frame = cfg.data.max_pixels / unit if cfg.data.max_pixels else 256
    total = cfg.data.total_pixels / unit if cfg.data.total_pixels else 8192
    return int(min(cfg.data.max_frames / v.temporal_patch * per_frame, total))


def zero_stage(cfg) -> tuple[int, bool]:
    """(stage, offload) from deepspeed.config (a JSON file) or deepspeed.zero_stage / deepspeed.offload."""
    stage, offload = cfg.deepspeed.zero_stage, cfg.deepspeed.offload
    if cfg.deepspeed.config:
        p = Path(cfg.deepspeed.config)
        if not p.is_file():
            raise UserError(f"deepspeed.config {cfg.deepspeed.config}: no such file")
        zero = json.loads(p.read_text()).get("zero_optimization", {})
        stage = int(zero.get("stage", stage))
        offload = offload or zero.get("offload_optimizer", {}).get("device") == "cpu"
    if offload:
        stage = 3  # deepspeed.offload is ZeRO-3 with optimizer and parameters on the CPU (mmpg.train.engine)
    return stage, offload


def recipe_from_config(cfg, gpus: int, device: str = "cuda", video: int | None = None,
                       prompt: int | None = None) -> Recipe:
    g = geometry_of(cfg.model.path)
    sp = cfg.parallel.sequence_parallel_size
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: give at least 1")
    if gpus % sp:
        raise UserError(f"parallel.sequence_parallel_size={sp} must divide --gpus {gpus}")
    if g.heads % sp:
        raise UserError(f"parallel.sequence_parallel_size={sp} must divide the model's {g.heads} attention heads")
    G, mb = cfg.rollout.n, cfg.trainer.micro_batch_size
    if mb % G:
        raise UserError(f"trainer.micro_batch_size={mb} must be a multiple of rollout.n={G} (whole groups per "
                        "micro-batch)")
    dp = gpus // sp
    if cfg.data.batch_size % dp:
        raise UserError(f"data.batch_size={cfg.data.batch_size} must divide over {dp} data-parallel groups")
    vt = video_tokens(cfg, g) if video is None else video
    P = prompt if prompt is not None else vt + TEXT_TOKENS
    if P <= vt:
        raise UserError(f"--prompt-tokens {P} must exceed the video's {vt} tokens")
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    b = 4 if dtype == "float32" else 2
    zero, offload = zero_stage(cfg)
    lora = cfg.model.lora.r
    ref = "none"
    if cfg.algorithm.beta > 0:
        ref = "adapters_off" if lora and cfg.model.ref_path in ("", cfg.model.path) else "copy"
    decode = "copy" if cfg.rollout.decode == "copy" else "cascade"
    return Recipe(g, P=P, S=cfg.rollout.max_new_tokens, G=G, video_tokens=vt, b=b, mixed=b == 2, zero=zero,
                  offload=offload, world=gpus, sp=sp, lora_r=lora, freeze_vision=cfg.model.freeze_vision,
                  train_merger=cfg.model.train_merger,
                  reference=ref, micro_groups=mb // G,
                  queries=cfg.data.queries_per_video if cfg.algorithm.share_videos else 1, prompts=math.ceil(cfg.data.batch_size / gpus),
                  ckpt=cfg.model.gradient_checkpointing, grouped=cfg.algorithm.grouping, decode=decode,
                  prefill_chunk=cfg.rollout.prefill_chunk, device="cpu" if device == "cpu" else "cuda",
                  self_check=cfg.algorithm.self_check != "off", decode_here=cfg.data.num_workers == 0,
                  runtime=RUNTIME_BYTES if device == "cpu" else 0.0, ragged=True)
