"""The value checks of the config tree (`mmpg.config`), run after defaults, YAML and overrides are merged
(OmegaConf checks types only): the allowed string choices and the ranges. Each failure is one `UserError` naming the
key, its value and what it must be. `video_checks` is the video block's (VideoSettings), shared with the eval
settings."""

from __future__ import annotations

from mmpg.errors import UserError

# Allowed values of the string choices, checked after the merge (OmegaConf checks types only).
CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.grouping_backend": ("auto", "sdpa", "flash", "flex"),
    "rollout.engine": ("hf", "vllm"),
    "rollout.decode": ("auto", "cascade", "copy"),
    "rollout.cascade_backend": ("auto", "flash", "sdpa", "math"),
    "rollout.decode_check": ("auto", "on", "off"),
    "reward.accuracy": ("iou_v2", "iou"),
    "algorithm.loss_type": ("grpo", "dapo", "dr_grpo"),
    "algorithm.self_check": ("on", "warn", "off"),
    "algorithm.scale_rewards": ("group", "batch", "none"),
    "optim.scheduler": ("constant", "cosine", "linear"),
    "checkpoint.optimizer_state": ("last", "all", "none"),  # mmpg.train.checkpoint.OPTIMIZER_STATE
    "trainer.device": ("auto", "cpu", "cuda"),
    "data.template": ("time_r1", "time_r1_frames", "answer_only", "zoom"),
    # mmpg.data.formats.FORMAT_CHOICES (tests/test_config.py keeps the two equal)
    "data.format": ("auto", "charades", "captions", "time_r1", "tvgbench", "timelens", "jsonl", "activitynet", "anet",
                    "charades_json", "charades_txt", "timelens_bench"),
}


def validate(cfg) -> None:
    """Raise one UserError for the first value out of its choices or range."""
    for key, allowed in CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in allowed:
            raise UserError(f"config key '{key}' is {value!r}; choose one of {', '.join(allowed)}")
    checks = [
        ("rollout.n", cfg.rollout.n >= 1, "must be >= 1"),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens >= 1, "must be >= 1"),
        ("rollout.temperature", cfg.rollout.temperature > 0, "must be > 0 for GRPO sampling"),
        ("rollout.tis_cap", cfg.rollout.tis_cap == 0 or cfg.rollout.tis_cap >= 1, "must be 0 (off) or >= 1"),
        ("rollout.max_staleness", cfg.rollout.max_staleness >= 0, "must be >= 0"),
        ("rollout.vllm_timeout_s", cfg.rollout.vllm_timeout_s > 0, "must be > 0"),
        ("rollout.vllm_sync_timeout_s", cfg.rollout.vllm_sync_timeout_s > 0, "must be > 0"),
        ("rollout.prefill_chunk", cfg.rollout.prefill_chunk >= 0, "must be >= 0 (0: no chunking)"),
        ("data.batch_size", cfg.data.batch_size >= 1, "must be >= 1"),
        ("data.queries_per_video", cfg.data.queries_per_video >= 1, "must be >= 1 (1: i.i.d. order)"),
        ("data.frame_cache_gb", cfg.data.frame_cache_gb > 0, "must be > 0"),
        ("trainer.micro_batch_size", cfg.trainer.micro_batch_size >= 1, "must be >= 1"),
        ("trainer.total_steps", cfg.trainer.total_steps >= 1, "must be >= 1"),
        ("algorithm.num_iterations", cfg.algorithm.num_iterations >= 1, "must be >= 1"),
        ("algorithm.beta", cfg.algorithm.beta >= 0, "must be >= 0"),
        ("deepspeed.zero_stage", cfg.deepspeed.zero_stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3"),
        ("parallel.sequence_parallel_size", cfg.parallel.sequence_parallel_size >= 1, "must be >= 1 (1: off)"),
        ("optim.lr", cfg.optim.lr >= 0, "must be >= 0"),
    ]
    checks += [(f"data.{name}", ok, what) for name, ok, what in video_checks(cfg.data)]
    for key, ok, what in checks:
        if not ok:
            group, name = key.split(".")
            raise UserError(f"config key '{key}' is {getattr(getattr(cfg, group), name)!r}; it {what}")
    _validate_lora(cfg.model.lora)
    _validate_zoom(cfg)
    if cfg.model.train_merger and (not cfg.model.freeze_vision or cfg.model.lora.r):
        why = "model.freeze_vision=false trains the whole tower already" if not cfg.model.freeze_vision else \
            f"with model.lora.r={cfg.model.lora.r} only the adapters train"
        raise UserError(f"config key 'model.train_merger' is True; {why}: set model.train_merger=false")


def _validate_zoom(cfg) -> None:
    """zoom.*'s values, and the trajectories SFT needs the template that offers the tool."""
    from mmpg.rollout.zoom import ZoomSettings

    problem = ZoomSettings(cfg.zoom.fps, cfg.zoom.max_frames, cfg.zoom.max_turns).problem()
    if problem:
        raise UserError(f"config key {problem}")
    for name in ("call_cost", "error_penalty", "window_weight"):
        value = getattr(cfg.zoom, name)
        if not value >= 0:
            raise UserError(f"config key 'zoom.{name}' is {value!r}; it must be >= 0")
    if cfg.sft.trajectories and cfg.data.template != "zoom":
        raise UserError(f"config key 'sft.trajectories' is set but data.template is {cfg.data.template!r}: "
                        "trajectories with zoom calls train behind the prompt that offers the tool (data.template=zoom)")
    if not cfg.sft.list_tools and not cfg.sft.trajectories:
        raise UserError("config key 'sft.list_tools' is false but sft.trajectories is empty: it leaves the zoom tool's "
                        "schema out of the prompt of trajectories that call it (a cold start's first stage)")


def video_checks(v) -> list[tuple[str, bool, str]]:
    """(field, passes, what it must be) for the fields of a VideoSettings block (data.* or an eval setting)."""
    return [
        ("fps", v.fps > 0, "must be > 0"),
        ("min_frames", v.min_frames >= 2, "must be >= 2 (two frames make one temporal patch)"),
        ("max_frames", v.max_frames >= v.min_frames, "must be >= min_frames"),
    ] + [(k, getattr(v, k) is None or getattr(v, k) > 0, "must be > 0 or null")
         for k in ("min_pixels", "max_pixels", "total_pixels")]


def _validate_lora(lora) -> None:
    """model.lora's values (which modules exist is checked on the loaded model, mmpg.models.lora)."""
    checks = [("r", lora.r >= 0, "must be >= 0 (0: LoRA off)"), ("alpha", lora.alpha > 0, "must be > 0"),
              ("dropout", 0 <= lora.dropout < 1, "must be in [0, 1)"),
              ("target_modules", lora.r == 0 or (bool(lora.target_modules) and all(
                  isinstance(t, str) and t.strip(". ") for t in lora.target_modules)),
               "must be a non-empty list of module names (e.g. [q_proj, v_proj])")]
    for name, ok, what in checks:
        if not ok:
            raise UserError(f"config key 'model.lora.{name}' is {getattr(lora, name)!r}; it {what}")
