"""Tiny checkpoints: real classes, round trip through save/load, processor + chat template, determinism."""

from __future__ import annotations

import hashlib

import pytest
import torch

from batches import random_video
from mmpg.toy.models import TinySpec, build_tiny_model, build_tiny_processor, make_tiny


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3"])
def test_round_trip_same_logits(family, tiny_dirs, load_tiny):
    processor = build_tiny_processor(family)
    tokenizer = getattr(processor, "tokenizer", processor)
    fresh = build_tiny_model(family, seed=0, tokenizer=tokenizer)
    loaded, _ = load_tiny(family)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        a, b = fresh(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert torch.equal(a, b), f"max diff {(a - b).abs().max()}"


def test_real_structure(load_tiny):
    model, _ = load_tiny("qwen2_5_vl")
    text = model.config.text_config
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert text.num_key_value_heads < text.num_attention_heads  # GQA
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert model.config.vision_config.depth >= 2 and model.config.vision_config.fullatt_block_indexes
    model3, _ = load_tiny("qwen3_vl")
    assert type(model3).__name__ == "Qwen3VLForConditionalGeneration"
    assert model3.config.vision_config.deepstack_visual_indexes


def test_small_enough_for_cpu(load_tiny):
    model, _ = load_tiny("qwen2_5_vl")
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_processor_chat_template_with_video(family, load_tiny):
    model, processor = load_tiny(family)
    messages = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                             {"type": "text", "text": "When does the red circle appear?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>When does the red circle appear?<|im_end|>\n" \
        in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n") == (family == "qwen2_5_vl")  # Qwen3-VL adds no system turn
    video = random_video(4, 56, 84, seed=0)
    enc = processor(text=[text], videos=[video], return_tensors="pt", do_sample_frames=False,
                    video_metadata=[{"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}],
                    size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112})
    merge = processor.video_processor.merge_size
    n_video_tokens = int((enc["input_ids"] == model.config.video_token_id).sum())
    assert n_video_tokens == int(enc["video_grid_thw"].prod()) // merge**2
    assert torch.equal(enc["mm_token_type_ids"] == 2, enc["input_ids"] == model.config.video_token_id)
    with torch.no_grad():
        out = model(**enc)
    assert torch.isfinite(out.logits).all()
    decoded = processor.tokenizer.decode(processor.tokenizer("<answer>12.5 to 20</answer>")["input_ids"])
    assert decoded == "<answer>12.5 to 20</answer>"


def test_same_seed_same_bytes(tmp_path):
    a = make_tiny("qwen3_vl", tmp_path / "a", seed=3)
    b = make_tiny("qwen3_vl", tmp_path / "b", seed=3)
    c = make_tiny("qwen3_vl", tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_configurable_sizes(tmp_path):
    spec = TinySpec(hidden_size=128, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=256)
    model = build_tiny_model("qwen2_5_vl", spec)
    assert model.config.text_config.num_hidden_layers == 3
    assert model.config.text_config.hidden_size == 128
