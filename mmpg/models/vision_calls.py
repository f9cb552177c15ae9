"""What the vision tower and the prefill actually did: counts that show whether a video's queries shared its work.

    with VisionCalls(policy, ref) as vision:      a forward hook on each model's vision tower (`model.model.visual`)
        ... rollout, reference and update forwards ...
    vision.take()  -> videos (and images) encoded since the last take: the rows of the grid_thw each call received
    with vision.paused(): ...                    forwards left out (a self-check's repeated forward)

A video asked Q questions is decoded once per batch (`mmpg.data.dataset`), but whether the tower then encodes it
once or Q times depends on the forward: the grouped forward with sharing (`mmpg.grouping.shares`) and a sharing
rollout engine encode it once, a per-query forward Q times. Counting the rows of `video_grid_thw` / `image_grid_thw`
handed to the tower (one row per video or image) measures that directly, whatever path did the forward, so training
(perf/vision_calls) and evaluation report the same figure. The hook only counts; it changes no input or output.
"""

from __future__ import annotations

import contextlib

import torch


def vision_towers(model) -> list[torch.nn.Module]:
    """The vision tower modules inside `model` (an HF Qwen-VL model, or a wrapper holding one): every submodule
    named `visual`, outermost only; [] for a text-only model."""
    found: list[torch.nn.Module] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "visual" and not any(module is f or _inside(module, f) for f in found):
            found.append(module)
    return found


def _inside(module: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return any(m is module for m in outer.modules())


class VisionCalls:
    """Counts the videos and images the vision towers of `models` encode (None entries are ignored; a model given
    twice, or a wrapper and its inner model, is hooked once)."""

    def __init__(self, *models):
        self.count = 0
        self._paused = 0
        self._handles = []
        seen: set[int] = set()
        for model in models:
            for tower in vision_towers(model) if model is not None else []:
                if id(tower) not in seen:
                    seen.add(id(tower))
                    self._handles.append(tower.register_forward_hook(self._hook, with_kwargs=True))

    @contextlib.contextmanager
    def paused(self):
        """Forwards that are not the job's own work (a self-check's repeated forward) go uncounted."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _hook(self, module, args, kwargs, output) -> None:
        if self._paused:
            return
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if isinstance(grid, torch.Tensor):
            self.count += int(grid.shape[0]) if grid.dim() > 1 else 1  # [n, 3]: one row per video or image

    def take(self) -> int:
        """Videos and images encoded since the last take (or since the hooks were placed); resets the count."""
        count, self.count = self.count, 0
        return count

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> VisionCalls:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefill_tokens(engine, prompt_inputs) -> int:
    """Prompt tokens the rollout engine's last `generate_groups` call prefilled: its own figure when it reports one
    (`engine.last_stats["prefix_tokens"]`: an engine that prefills a video's queries once counts the shared part
    once), else every prompt's length (each prompt prefilled on its own)."""
    stats = getattr(engine, "last_stats", None)
    if isinstance(stats, dict) and isinstance(stats.get("prefix_tokens"), int):
        return int(stats["prefix_tokens"])
    from mmpg.grouping.inputs import prompt_attention_mask

    return int(prompt_attention_mask(prompt_inputs).sum())
