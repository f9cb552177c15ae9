"""The `Recipe` one device runs, what the memory and time models compute from, and how a resolved config and a
device count become one (`recipe_from_config`): model geometry, dtype, ZeRO stage and sharding, LoRA, reference,
the prompt's tokens, the micro-batch. (The CPU validation's bench cases build theirs: `mmpg.plan.validate`.)

Prompt tokens: the video's LM tokens are the data budget's worst case (a video long enough to reach
data.max_frames), as qwen-vl-utils sizes it: min(max_frames / 2 · max_pixels, total_pixels) / (patch · merge)²,
the per-frame and whole-video defaults (256 tokens a frame, 8192 a video) where the config leaves them null; plus
TEXT_TOKENS of system prompt, template and question. `--video-tokens` / `--prompt-tokens` override both.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from mmpg.errors import UserError
from mmpg.models.geometry import Geometry, resolve

TEXT_TOKENS = 120
# A CPU training run's own objects besides the planned tensors (the model's and processor's Python objects, DeepSpeed's
# bookkeeping, the loader's side of its worker): 4.1-11.9 MB measured in `mmpg train` runs (docs/plan.md, "runtime")
RUNTIME_BYTES = 6 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What one device runs. Token counts are per prompt; `prompts` the rollout batch per rank."""

    geometry: Geometry
    P: int
    S: int
    G: int
    video_tokens: int = 0
    b: int = 2  # bytes per value of the compute dtype
    mixed: bool = True  # 16-bit weights with an fp32 master copy (False: everything in float32)
    zero: int = 0
    offload: bool = False
    world: int = 1  # ranks ZeRO shards over
    sp: int = 1
    lora_r: int = 0
    freeze_vision: bool = True
    train_merger: bool = False  # the tower frozen but its patch merger (model.train_merger)
    reference: str = "none"  # none | copy | adapters_off
    micro_groups: int = 1  # k: groups per micro-batch
    queries: int = 1  # Q: adjacent queries of one video sharing it (data.queries_per_video, grouped only)
    prompts: int = 1  # B: prompts rolled out at once per rank
    ckpt: bool = False
    grouped: bool = True
    decode: str = "cascade"  # cascade | copy (the naive layout rolls out with generate: copy)
    prefill_chunk: int = 8192
    cold: bool = False  # the first step: AdamW's state is allocated at the optimizer step (a CPU measurement's)
    full_logits: bool = False  # logits at every position of every row, kept with their log-softmax (R1-V-derived
    #                            trainers: Video-R1, VideoChat-R1), instead of response positions only
    device: str = "cuda"  # "cpu": the memory model's CPU-only terms (`mmpg.plan.memory`)
    self_check: bool = False  # algorithm.self_check on (grouped runs): its phase, counted on the CPU only
    decode_here: bool = False  # videos decoded in the training process (data.num_workers 0), not in workers
    runtime: float = 0.0  # bytes a CPU training process holds besides the planned tensors (RUNTIME_BYTES)
    ragged: bool = False  # responses of unequal length (a run's, not the bench's S each): the naive rows are padded

    @property
    def patches(self) -> int:
        v = self.geometry.vision
        return self.video_tokens * v.merge ** 2 if v else 0

    def trainable(self) -> int:
        g = self.geometry
        if self.lora_r:
            return g.lora_params(self.lora_r)
        frozen = g.vision.params() - (g.vision.merger_params() if self.train_merger else 0) if g.vision else 0
        return g.params() - (frozen if self.freeze_vision else 0)

    def videos(self, groups: int) -> int:
        """Videos among `groups` prompts: one per prompt, or one per Q queries sharing it."""
        return -(-groups // self.queries) if self.grouped else groups

    def update_tokens(self) -> int:
        k = self.micro_groups
        if self.grouped and self.queries > 1:  # [shared video part | tail + response, ...]: mmpg.grouping.shares
            tail = self.P - self.video_tokens
            return self.videos(k) * (self.P - tail) + k * self.G * (tail + self.S)
        return k * (self.P + self.G * self.S) if self.grouped else k * self.G * (self.P + self.S)


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


ZOOM_TURN_TEXT = 40  # tokens of a zoom tool turn besides its clip (<tool_response>, the window's times)


def response_tokens(cfg, g: Geometry) -> int:
    """The longest response of a row: rollout.max_new_tokens, or with the zoom tool (data.template=zoom) the longest
    trajectory after the prompt: zoom.max_turns + 1 model turns and zoom.max_turns tool turns, each a clip of up to
    zoom.max_frames frames sized as data.* sizes frames."""
    S = cfg.rollout.max_new_tokens
    if cfg.data.template != "zoom" or g.vision is None:
        return S
    v = g.vision
    per_frame = cfg.data.max_pixels / (v.patch * v.merge) ** 2 if cfg.data.max_pixels else 256
    clip = int(cfg.zoom.max_frames / v.temporal_patch * per_frame)
    return (cfg.zoom.max_turns + 1) * S + cfg.zoom.max_turns * (clip + ZOOM_TURN_TEXT)


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
    return Recipe(g, P=P, S=response_tokens(cfg, g), G=G, video_tokens=vt, b=b, mixed=b == 2, zero=zero,
                  offload=offload, world=gpus, sp=sp, lora_r=lora, freeze_vision=cfg.model.freeze_vision,
                  train_merger=cfg.model.train_merger, reference=ref, micro_groups=mb // G,
                  queries=cfg.data.queries_per_video if cfg.algorithm.share_videos else 1,
                  prompts=math.ceil(cfg.data.batch_size / gpus),
                  ckpt=cfg.model.gradient_checkpointing, grouped=cfg.algorithm.grouping, decode=decode,
                  prefill_chunk=cfg.rollout.prefill_chunk, device="cpu" if device == "cpu" else "cuda",
                  self_check=cfg.algorithm.self_check != "off", decode_here=cfg.data.num_workers == 0,
                  runtime=RUNTIME_BYTES if device == "cpu" else 0.0, ragged=True)
