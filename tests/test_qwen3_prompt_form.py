"""Qwen3-VL prompts in the form the model was released with (`mmpg.data.video_form`), on every path that builds one.

The released form writes each temporal patch (two frames) as `<t seconds><|vision_start|><|video_pad|>*n
<|vision_end|>`, with no pair around the frames; transformers 5.x's processor, given the chat template's text, adds
one (`<|vision_start|><0.3 seconds><|vision_start|>...<|vision_end|><|vision_end|>`). Most cases use the real
Qwen3-VL-4B-Instruct processor files (`../shared/data/real/processors`, skipped when absent) and a model shrunk from
its config.json (vocab 151,936, the real special-token ids, rope and interleaved mRoPE [24, 20, 20] at head_dim 128).
The expected ids are those transformers 4.57.1, the processor Qwen3-VL was released with, wrote for the same video
and text from these files. Bounds: tests/grouping_check.py's (float32 logprobs 1e-5, gradients 1e-4 relative).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from batches import assert_recompute_matches, completions, random_video, write_mp4
from grouping_check import compare

from mmpg.data.prompts import PromptTemplate, build_prompt_inputs
from mmpg.data.samples import GroundingSample
from mmpg.data.video import DecodedVideo
from mmpg.data.video_form import check_released_form, released_video_text

REAL = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "real" / "processors"
real = pytest.mark.skipif(not (REAL / "qwen3_vl" / "vocab.json").is_file(),
                          reason="the real processor files (../shared/data/real/processors) are absent")

VS, VE, PAD = 151652, 151653, 151656  # <|vision_start|>, <|vision_end|>, <|video_pad|> (tokenizer_config.json)
FRAME = [VS] + [PAD] * 6 + [VE]  # 64x96 frames: 4x6 patches of 16, merged 2x2 -> 6 tokens
# transformers 4.57.1 on the real files: chat template + Qwen3VLProcessor, the VIDEO below, "Where is the cat?"
RELEASED = ([151644, 872, 198]  # <|im_start|> user \n
            + [27, 15, 13, 18, 6486, 29] + FRAME  # <0.3 seconds>: frames 2 and 14 at 25 fps, (2 + 14) / 2 / 25 = 0.32
            + [27, 16, 13, 18, 6486, 29] + FRAME  # <1.3 seconds>: (26 + 38) / 2 / 25 = 1.28
            + [27, 17, 13, 17, 6486, 29] + FRAME  # <2.2 seconds>: (50 + 62) / 2 / 25 = 2.24
            + [9064, 374, 279, 8251, 30, 151645, 198, 151644, 77091, 198])  # Where is the cat? <|im_end|> ... assistant
END = 3 + 3 * (6 + len(FRAME))  # where the video ends in RELEASED
CAT = PromptTemplate("Where is the cat?", think=False)


def decoded_video(frames: int, height: int, width: int, seed: int, first: int = 2) -> DecodedVideo:
    """Frames as qwen-vl-utils hands them (float, 0..255), taken every 12th frame of a 25 fps file from `first`."""
    indices = [first + 12 * i for i in range(frames)]
    meta = {"fps": 25.0, "total_num_frames": 200, "frames_indices": indices, "video_backend": "decord"}
    return DecodedVideo(frames=random_video(frames, height, width, seed).float(), timestamps=[i / 25 for i in indices],
                        sample_fps=25 / 12, metadata=meta, path=f"v{seed}.mp4", duration=8.0)


def grounding(n: int) -> list[GroundingSample]:
    return [GroundingSample(sample_id=f"v{i}#0", video=f"v{i}.mp4", duration=8.0, query=q, span=(1.0, 2.0))
            for i, q in zip(range(n), ["the cat jumps", "a door opens slowly", "someone sits down"])]


def expand(processor, text: str, video: DecodedVideo) -> torch.Tensor:
    """[1, P] ids: the processor of this transformers on a text as it is (no change to its video placeholder)."""
    cap = {"cap_pixels_per_frame": True} if hasattr(processor.video_processor, "cap_pixels_per_frame") else {}
    return processor(text=[text], videos=[video.frames], video_metadata=[dict(video.metadata)], do_sample_frames=False,
                     do_resize=False, return_tensors="pt", **cap)["input_ids"]


def released_positions(ids: list[int], grid_hw: tuple[int, int], merge: int = 2) -> torch.Tensor:
    """[3, P] mRoPE positions of a one-video released-form prompt, by the rule of Qwen's code: a text token is one
    past the one before (all three axes); each frame (temporal patch) is its own block, t at its start, h and w its
    row and column from there; whatever follows a block starts one past the largest position used."""
    h, w = grid_hw[0] // merge, grid_hw[1] // merge
    rows, nxt, i = [], 0, 0
    while i < len(ids):
        if ids[i] == PAD:
            t = torch.full((h * w,), nxt)
            hh = torch.arange(h).repeat_interleave(w) + nxt
            ww = torch.arange(w).repeat(h) + nxt
            rows.append(torch.stack([t, hh, ww]))
            nxt, i = nxt + max(h, w), i + h * w
        else:
            rows.append(torch.full((3, 1), nxt))
            nxt, i = nxt + 1, i + 1
    return torch.cat(rows, dim=1)


@pytest.fixture(scope="module")
def q3():
    from mmpg.models.loading import load_processor

    return load_processor(REAL / "qwen3_vl")


@pytest.fixture(scope="module")
def shrunk():
    """Qwen3-VL-4B's config.json with small widths and depths; everything that decides the prompt and the positions
    (vocab, token ids, rope_theta, mrope_section, head_dim, patch and merge sizes) as released."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = json.loads((REAL / "qwen3_vl" / "config.json").read_text())
    config["text_config"].update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1)
    config["vision_config"].update(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                                   deepstack_visual_indexes=[0])
    config = Qwen3VLConfig.from_dict(config)
    config._attn_implementation = "sdpa"
    assert config.text_config.rope_parameters["mrope_section"] == [24, 20, 20] and config.text_config.head_dim == 128
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).float().eval()


@real
def test_builder_writes_the_released_form(q3):
    inputs = build_prompt_inputs(q3, grounding(1), [decoded_video(6, 64, 96, seed=0)], CAT)
    ids = inputs["input_ids"][0].tolist()
    assert ids == RELEASED, f"mmpg wrote {q3.tokenizer.decode(ids)!r}"
    assert inputs["video_grid_thw"].tolist() == [[3, 4, 6]]
    assert inputs["mm_token_type_ids"][0].tolist() == [2 if t == PAD else 0 for t in RELEASED]
    # what the processor of this transformers writes from the template's text as it is: the pair around the frames
    template = q3.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {
        "type": "text", "text": "Where is the cat?"}]}], tokenize=False, add_generation_prompt=True)
    raw = expand(q3, template, decoded_video(6, 64, 96, seed=0))
    if raw[0].tolist() != RELEASED:  # transformers 5.x: two tokens more, which the builder's check refuses
        assert raw[0].tolist() == RELEASED[:3] + [VS] + RELEASED[3:END] + [VE] + RELEASED[END:]
        with pytest.raises(RuntimeError, match="not the released form"):
            check_released_form(q3, raw)


@real
def test_positions_follow_the_released_form(q3, shrunk):
    """The model's own get_rope_index on mmpg's prompt, left padded beside a longer one: Qwen's rule, at every
    prompt token (transformers 4.57.1 gives the same on this prompt)."""
    videos = [decoded_video(6, 64, 96, seed=0), decoded_video(4, 96, 64, seed=1, first=0)]
    inputs = build_prompt_inputs(q3, grounding(2), videos, CAT)
    pos, _ = shrunk.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                         video_grid_thw=inputs["video_grid_thw"],
                                         attention_mask=inputs["attention_mask"])
    for b, video in enumerate(videos):
        keep = inputs["attention_mask"][b].bool()
        grid_hw = (video.frames.shape[2] // 16, video.frames.shape[3] // 16)  # patches of 16 pixels
        want = released_positions(inputs["input_ids"][b][keep].tolist(), grid_hw)
        assert torch.equal(pos[:, b, keep], want), f"prompt {b}: positions differ from Qwen's rule"


@real
def test_grouped_equals_repeated_and_rollout_on_released_prompts(q3, shrunk):
    """Training (grouped vs repeated, logprobs and every gradient) and the HF rollout engine (its logprobs against
    the grouped recompute) on the released form: three videos of different sizes, unequal groups and lengths."""
    from mmpg.rollout import HFEngine, SamplingParams

    videos = [decoded_video(6, 64, 96, seed=0), decoded_video(4, 96, 64, seed=1, first=0),
              decoded_video(2, 32, 32, seed=2)]
    inputs = build_prompt_inputs(q3, grounding(3), videos, CAT)
    ids, mask = completions([3, 1, 2], [5, 1, 7, 4, 6, 2], shrunk.config.text_config.vocab_size, seed=0)
    logp, grad, _ = compare(shrunk, inputs, ids, mask, [3, 1, 2])
    print(f"\nreleased-form prompts: grouped vs repeated logprobs {logp:.2e}, gradients {grad:.2e} (relative)")
    rollout = HFEngine(shrunk, q3).generate_groups(inputs, 2, SamplingParams(max_new_tokens=4, seed=3))
    assert_recompute_matches(shrunk, inputs, rollout, temperature=1.0, atol=1e-5)


@real
def test_training_sft_and_eval_batches_are_released(q3, tmp_path):
    """The collator (training and SFT batches) and the evaluation's batches decode a real mp4 and build the prompt
    through the builder: each in the released form."""
    import numpy as np

    from mmpg.data.dataset import GroundingCollator, GroundingDataset
    from mmpg.data.video import VideoSpec
    from mmpg.eval.batches import _Collate

    path = write_mp4(tmp_path / "clip.mp4", (np.full((64, 96, 3), 16 * i, np.uint8) for i in range(16)), fps=4)
    sample = GroundingSample(sample_id="clip#0", video=str(path), duration=4.0, query="the cat jumps", span=(1, 2))
    spec = VideoSpec.for_family("qwen3_vl", fps=2.0, min_pixels=64 * 96, max_pixels=64 * 96)
    item = GroundingDataset([sample], spec)[0]
    assert item.ok, item.error
    train = GroundingCollator(q3, CAT)([item]).inputs
    _, _, evaluation, _ = _Collate(q3, CAT)([(0, item)])
    for inputs in (train, evaluation):
        text = q3.tokenizer.decode(inputs["input_ids"][0])
        assert re.match(r"<\|im_start\|>user\n<0\.\d seconds><\|vision_start\|><\|video_pad\|>", text), text
        assert "<|vision_end|><|vision_end|>" not in text and not re.search(r"<\|vision_start\|><\d", text), text
    assert torch.equal(train["input_ids"], evaluation["input_ids"])


@real
def test_vllm_wire_sends_one_token_and_its_expansion_is_the_prompt(q3, shrunk):
    """The engine sends each video as a bare <|video_pad|>; expanding it again from the frames, as vLLM 0.32 on
    transformers >= 5.10 does (it replaces the bare video token), gives the trainer's prompt token for token. A
    prompt in 5.x's nested form round-trips too (its pair is kept)."""
    from mmpg.rollout.vllm_prompt import wire_collapser

    video = decoded_video(6, 64, 96, seed=0)
    inputs = build_prompt_inputs(q3, grounding(1), [video], CAT)
    collapse = wire_collapser(shrunk, q3)
    sent = collapse(inputs["input_ids"][0].tolist())
    assert sent == RELEASED[:3] + [PAD] + RELEASED[END:]
    assert expand(q3, q3.tokenizer.decode(sent), video)[0].tolist() == RELEASED
    nested = RELEASED[:3] + [VS] + RELEASED[3:END] + [VE] + RELEASED[END:]
    assert collapse(nested) == RELEASED[:3] + [VS, PAD, VE] + RELEASED[END:]


def test_tiny_processor_prompt_is_released_and_qwen2_5_vl_keeps_its_pair():
    """Without the real files: the toy Qwen3-VL processor through the builder (frames 0.5 s apart), and Qwen2.5-VL,
    whose released form is the template's pair around its run of video tokens."""
    from mmpg.toy.models import build_tiny_processor

    q3_tiny, q25 = build_tiny_processor("qwen3_vl"), build_tiny_processor("qwen2_5_vl")
    video = decoded_video(4, 64, 64, seed=0)
    text = q3_tiny.tokenizer.decode(build_prompt_inputs(q3_tiny, grounding(1), [video], CAT)["input_ids"][0])
    assert re.search(r"user\n<0\.3 seconds><\|vision_start\|>(<\|video_pad\|>){4}<\|vision_end\|><1\.3 seconds>"
                     r"<\|vision_start\|>(<\|video_pad\|>){4}<\|vision_end\|>Where", text), text
    template = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Where is the cat?<|im_end|>\n"
    assert released_video_text(q3_tiny, template) == "<|im_start|>user\n<|video_pad|>Where is the cat?<|im_end|>\n"
    assert released_video_text(q25, template) == template
    video = decoded_video(4, 56, 56, seed=0)
    text = q25.tokenizer.decode(build_prompt_inputs(q25, grounding(1), [video], CAT)["input_ids"][0])
    assert re.search(r"user\n<\|vision_start\|>(<\|video_pad\|>){8}<\|vision_end\|>Where", text), text
