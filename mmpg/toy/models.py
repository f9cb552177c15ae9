"""Tiny, seeded, random-weight Qwen checkpoints built offline (`mmpg make-tiny`).

Tests, the demo and CPU benchmarks need no download: they use checkpoints built here, of the
real transformers classes (Qwen2.5-VL, Qwen3-VL, and the text-only Qwen2 / Qwen3 causal LMs) with small sizes but the
real structure — grouped-query attention, mRoPE sections scaled to the head size, a vision tower of depth >= 2 (window
+ full attention for Qwen2.5-VL, deepstack taps for Qwen3-VL) — plus a locally trained Qwen-style tokenizer and the
family's real image and video processors. Everything is written with `save_pretrained` and loads with
`AutoProcessor.from_pretrained` / `AutoModelForImageTextToText.from_pretrained` like a hub checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmpg.errors import UserError
from mmpg.toy.tokenizer import build_tokenizer

VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
TEXT_FAMILIES = ("qwen2", "qwen3")
FAMILIES = VL_FAMILIES + TEXT_FAMILIES


@dataclasses.dataclass
class TinySpec:
    """Sizes of a tiny checkpoint. Defaults: a forward+backward on a short video in well under a second on a CPU."""

    hidden_size: int = 64  # text hidden size
    num_layers: int = 2  # text decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA when < num_heads)
    intermediate_size: int = 128
    vision_depth: int = 2  # vision blocks (>= 2: window + full attention / deepstack taps)
    vision_hidden_size: int = 32
    vision_heads: int = 2
    vocab_size: int = 2048  # upper bound: the trained BPE stops earlier when the corpus runs out of merges

    def check(self) -> None:
        if min(dataclasses.astuple(self)) <= 0:
            raise UserError(f"tiny model sizes must be positive, got {self}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise UserError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}, "
                f"and num_heads by num_kv_heads {self.num_kv_heads}"
            )
        if (self.hidden_size // self.num_heads) % 8:
            raise UserError(f"head size {self.hidden_size // self.num_heads} must be a multiple of 8 (mRoPE sections)")
        if self.vision_depth < 2 or self.vision_hidden_size % self.vision_heads:
            raise UserError("vision_depth must be >= 2 and vision_hidden_size divisible by vision_heads")


def _mrope_section(head_dim: int, ratios: tuple[int, int, int]) -> list[int]:
    """Split head_dim/2 rotary frequencies into (temporal, height, width) sections in the family's proportions."""
    half = head_dim // 2
    sec = [half * r // sum(ratios) for r in ratios]
    sec[0] += half - sum(sec)
    return sec


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


def build_tiny_processor(family: str, spec: TinySpec | None = None, seed: int = 0):
    """The family's processor (tokenizer, image processor, video processor) for a tiny checkpoint.

    Text-only families return just the tokenizer, as their hub checkpoints do."""
    _check_family(family)
    spec = spec or TinySpec()
    if family in TEXT_FAMILIES:
        return build_tokenizer(spec.vocab_size, seed)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        tokenizer = build_tokenizer(spec.vocab_size, seed, default_system="You are a helpful assistant.")
        return Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2),
            video_processor=Qwen2VLVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tokenizer = build_tokenizer(spec.vocab_size, seed, default_system=None)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2),
        video_processor=Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def _token_ids(tokenizer) -> dict[str, int]:
    ids = dict(zip(["image", "video", "start", "end", "eos", "pad"], tokenizer.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>", "<|endoftext|>"])))
    ids["vocab"] = len(tokenizer)
    return ids


def tiny_config(family: str, spec: TinySpec, tokenizer):
    """The transformers config of a tiny checkpoint; `tokenizer` fixes the vocabulary and special-token ids."""
    _check_family(family)
    spec.check()
    ids = _token_ids(tokenizer)
    head_dim = spec.hidden_size // spec.num_heads
    text = dict(
        vocab_size=ids["vocab"], hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=ids["eos"],
        pad_token_id=ids["pad"], tie_word_embeddings=False,
    )
    vision_tokens = dict(image_token_id=ids["image"], video_token_id=ids["video"],
                         vision_start_token_id=ids["start"], vision_end_token_id=ids["end"])
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                   "mrope_section": _mrope_section(head_dim, (16, 24, 24))}
        vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size, num_heads=spec.vision_heads,
                      intermediate_size=2 * spec.vision_hidden_size, out_hidden_size=spec.hidden_size, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=112,
                      fullatt_block_indexes=list(range(1, spec.vision_depth, 2)))
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **vision_tokens)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text.update(head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
            "mrope_section": _mrope_section(head_dim, (24, 20, 20))})
        vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size, num_heads=spec.vision_heads,
                      intermediate_size=2 * spec.vision_hidden_size, out_hidden_size=spec.hidden_size, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                      deepstack_visual_indexes=list(range(min(spec.vision_depth, spec.num_layers))))
        return Qwen3VLConfig(text_config=text, vision_config=vision, **vision_tokens)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**text, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    from transformers import Qwen3Config

    return Qwen3Config(**text, head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def build_tiny_model(family: str, spec: TinySpec | None = None, seed: int = 0, tokenizer=None):
    """A seeded random-init model of the family's real transformers class, float32, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    spec = spec or TinySpec()
    tokenizer = tokenizer or build_tokenizer(spec.vocab_size, seed)
    config = tiny_config(family, spec, tokenizer)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family in VL_FAMILIES else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = config.get_text_config().pad_token_id
    return model.eval()


def make_tiny(family: str, out: str | Path, seed: int = 0, spec: TinySpec | None = None,
              overwrite: bool = False) -> Path:
    """Build and save a tiny checkpoint (model + processor) into `out`; nothing is left half-written on failure."""
    _check_family(family)
    spec = spec or TinySpec()
    spec.check()
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} is not empty; pass --overwrite or choose another folder")
    processor = build_tiny_processor(family, spec, seed)
    tokenizer = getattr(processor, "tokenizer", processor)
    model = build_tiny_model(family, spec, seed, tokenizer)
    from mmpg.models.loading import save_model_folder

    return save_model_folder(out, model, processor)
