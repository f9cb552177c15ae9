"""What the vLLM engine sends for a prompt's videos (no server needed): each video back as the one video token vLLM
expands again from the frames (Qwen2.5-VL inside its `<vs> <ve>` pair, Qwen3-VL's timestamped frames as a bare
token); each distinct video of a batch once (wire 2), what the server makes of both wire forms, and `last_stats` from
an answer's counters."""

from __future__ import annotations

from mmpg.rollout.vllm_prompt import collapse_videos

VS, VE, PAD = 1, 2, 9  # vision start, vision end, video token
T1, T2 = [50, 51, 52], [50, 53, 52]  # timestamp text tokens ("<0.3 seconds>", "<1.3 seconds>")
T10 = [50, 54, 55, 51, 52]  # "<10.3 seconds>": its tail [55, 51, 52] alone is no timestamp


def is_ts(ids):
    return ids in (T1, T2, T10)


def test_qwen2_5_vl_run_becomes_one_token():
    assert collapse_videos([7, VS, PAD, PAD, PAD, VE, 8], PAD, (VS, VE)) == [7, VS, PAD, VE, 8]
    assert collapse_videos([7, VS, PAD, PAD, PAD, VE, 8], PAD, (VS, VE), is_ts) == [7, VS, PAD, VE, 8]


def test_qwen3_vl_released_frames_become_one_bare_token():
    """The released form (mmpg's prompts): each frame its timestamp, then <vs> pads <ve>; no pair around them."""
    ids = [7, *T1, VS, PAD, PAD, VE, *T2, VS, PAD, PAD, VE, *T10, VS, PAD, PAD, VE, 8]
    assert collapse_videos(ids, PAD, (VS, VE), is_ts) == [7, PAD, 8]


def test_qwen3_vl_nested_frames_keep_the_outer_pair():
    """transformers 5.x's own form, a pair around the frames: the pair stays, vLLM expands the token inside it."""
    ids = [7, VS, *T1, VS, PAD, PAD, VE, *T2, VS, PAD, PAD, VE, VE, 8, VS, *T1, VS, PAD, VE, VE]  # two videos
    assert collapse_videos(ids, PAD, (VS, VE), is_ts) == [7, VS, PAD, VE, 8, VS, PAD, VE]


def test_text_and_unclosed_pairs_are_kept():
    assert collapse_videos([7, VS, 8, VE, 9], PAD, (VS, VE), is_ts) == [7, VS, 8, VE, 9]  # a pair without video
    assert collapse_videos([7, VS, PAD, PAD], PAD, (VS, VE), is_ts) == [7, VS, PAD]  # never closed: runs collapsed
    assert collapse_videos([7, *T1, 8, VS, PAD, VE], PAD, (VS, VE), is_ts) == [7, *T1, 8, VS, PAD, VE]  # not before
    assert collapse_videos([7, 8], None, None) == [7, 8]  # a text model


# ---- a video once per batch (wire 2) ------------------------------------------------------------------------------
def _video(seed: int, fps: float = 2.0):
    import torch

    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, 256, (2, 3, 28, 28), generator=g).float()
    return frames, {"fps": fps, "total_num_frames": 2, "frames_indices": [0, 1]}


def test_distinct_videos_by_object_and_by_content():
    from mmpg.rollout.vllm_prompt import distinct_videos

    a, b = _video(0), _video(1)
    a_copy = (a[0].clone(), dict(a[1]))  # another object, equal frames and metadata: the same video
    a_fps = (a[0], dict(a[1], fps=4.0))  # same frames, other fps (other Qwen3-VL timestamps): another video
    table, index = distinct_videos([a, a, None, b, a_copy, a, a_fps])
    assert index == [0, 0, None, 1, 0, 0, 2] and len(table) == 3
    assert table[0][0] is a[0] and table[2][1]["fps"] == 4.0


def test_rollout_stats_counts_hand_worked():
    """[A q1, A q2, text, A q3] of 10, 11, 5, 12 tokens, G = 2: vLLM looked up 2 x 38 = 76 prompt tokens and found
    50 (the other sample of each prompt, and A's video block for q2, q3), so it computed 26."""
    from mmpg.rollout.vllm_prompt import rollout_stats

    ids = [[1] * 10, [1] * 11, [2] * 5, [1] * 12]
    answer = {"counters": {"prefix_cache_queries": 76, "prefix_cache_hits": 50, "mm_cache_queries": 3,
                           "mm_cache_hits": 2}, "timing_s": {"enqueue": 0.5}}
    stats = rollout_stats(ids, [0, 0, None, 0], answer, 1234)
    assert stats == {"prompts": 4, "prefixes": 2, "prefix_tokens": 26, "shared_prompts": 2, "cached_tokens": 50,
                     "videos": 1, "request_bytes": 1234, "processor_runs": 1, "timing_s": {"enqueue": 0.5},
                     "version": None}


def test_server_builds_one_item_per_video_named_by_content():
    """The server side of both wire forms (no vLLM needed): wire 2 hands every prompt of a video one frames array
    and one content name; wire 1 gives each prompt its own frames and no name (vLLM hashes them)."""
    import numpy as np

    from mmpg.serve.requests import video_table as _video_table, vllm_prompt as _prompt
    from mmpg.serve.wire import frames_array, video_digest

    (fa, ma), (fb, mb) = _video(0), _video(1)
    arrays = {"video_0": frames_array(fa), "video_1": frames_array(fb)}
    meta = {"videos": [{"key": "video_0", "metadata": ma}, {"key": "video_1", "metadata": mb}]}
    table = _video_table(meta, arrays)
    got = [_prompt({"token_ids": [7, 1, 9, 2], "video": v}, arrays, table) for v in (0, 1, 0, None)]
    assert got[0]["multi_modal_data"]["video"][0][0] is got[2]["multi_modal_data"]["video"][0][0]
    assert got[0]["multi_modal_uuids"] == got[2]["multi_modal_uuids"] != got[1]["multi_modal_uuids"]
    assert got[3] == {"prompt_token_ids": [7, 1, 9, 2]}
    old = _prompt({"token_ids": [7, 1, 9, 2], "video": {"key": "video_0", "metadata": ma}}, arrays, None)
    assert "multi_modal_uuids" not in old
    np.testing.assert_array_equal(old["multi_modal_data"]["video"][0][0], got[0]["multi_modal_data"]["video"][0][0])
    assert old["multi_modal_data"]["video"][0][1] == got[0]["multi_modal_data"]["video"][0][1]
    one_pixel = arrays["video_0"].copy()
    one_pixel[0, 0, 0, 0] ^= 1
    name = video_digest(arrays["video_0"], ma)
    assert video_digest(one_pixel, ma) != name != video_digest(arrays["video_0"], dict(ma, fps=3.0))


def test_a_prompt_holds_several_videos_in_order():
    """Wire 3 (multi-turn: an overview and its clips): the server gives vLLM a prompt's videos in order, each named
    by its content, the overview shared with the other prompts that hold it; the engine sends each prompt's videos
    as a list of table indices, each distinct video once, and refuses a count that does not match the prompt's
    video tokens or the server's --videos-per-prompt."""
    import pytest

    from mmpg.rollout.vllm import VLLMEngine
    from mmpg.serve.requests import video_table as _video_table, vllm_prompt as _prompt
    from mmpg.serve.wire import ServerError, frames_array

    (fa, ma), (fb, mb) = _video(0), _video(1)
    arrays = {"video_0": frames_array(fa), "video_1": frames_array(fb)}
    table = _video_table({"videos": [{"key": "video_0", "metadata": ma}, {"key": "video_1", "metadata": mb}]}, arrays)
    two = _prompt({"token_ids": [7, 1, 9, 1], "videos": [0, 1]}, arrays, table)
    one = _prompt({"token_ids": [7, 1], "videos": [0]}, arrays, table)
    assert [item[0] for item in two["multi_modal_data"]["video"]] == [table[0][0][0], table[1][0][0]]
    assert two["multi_modal_uuids"]["video"] == [table[0][1], table[1][1]]
    assert one["multi_modal_uuids"]["video"] == [table[0][1]]
    assert _prompt({"token_ids": [7], "videos": []}, arrays, table) == {"prompt_token_ids": [7]}
    with pytest.raises(ValueError, match="names video 2; the request's table holds 2"):
        _prompt({"token_ids": [7], "videos": [0, 2]}, arrays, table)

    class Model:  # a text-free stand-in: video token 1, no brackets (ids already as the wire sends them)
        config = type("C", (), {"video_token_id": 1, "model_type": "qwen2_5_vl"})()

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.model, engine.processor, engine.url, engine.banned = Model(), None, "http://x", []
    engine.health, engine.version = {"instance": "i", "videos_per_prompt": 2}, 0
    clip = _video(2)
    from mmpg.rollout import SamplingParams

    sampling = SamplingParams(stop_token_ids=(0,))
    meta, sent = engine._request([[7, 1, 9, 1], [8, 1]], [2, 1], [3, 4], sampling, None, [[fa_ma := (fa, ma), clip],
                                                                                          fa_ma])
    assert [p["videos"] for p in meta["prompts"]] == [[0, 1], [0]] and len(sent) == 2  # the overview sent once
    with pytest.raises(ValueError, match="prompt 0 holds 2 videos and 1 were given"):
        engine._request([[7, 1, 9, 1]], [1], [3], sampling, None, [[fa_ma]])
    with pytest.raises(ServerError, match="takes 2 per prompt: restart it with --videos-per-prompt 3"):
        engine._request([[1, 9, 1, 9, 1]], [1], [3], sampling, None, [[fa_ma, clip, clip]])


def test_wire_version_check():
    import pytest

    from mmpg.serve.wire import WIRE_VERSION, ServerError, check_wire

    check_wire({"wire": WIRE_VERSION}, "http://x")
    with pytest.raises(ServerError, match=f"speaks wire format 1, this client {WIRE_VERSION}.*restart it from this"):
        check_wire({}, "http://x")
