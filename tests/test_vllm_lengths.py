"""The vLLM server's length agreed before training (`mmpg.rollout.lengths`): the config's worst prompt against what
the data pipeline really makes (the 7B config's 64 frames of 448x448 through qwen-vl-utils and the released
processors), `mmpg vllm-len` and the launch script's derived --max-model-len, the trainer's check of the server's
/health before the first step, too-long prompts dropped from a batch as skips, and a server that dies before it
answers ending the trainer's wait with its log. The real vLLM server's run with a too-long prompt is in
tests/test_vllm_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mmpg.config import load_config
from mmpg.errors import UserError
from mmpg.rollout import lengths
from mmpg.serve.launch import free_port
from mmpg.serve.wire import WIRE_VERSION, ServerError

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / ".." / "shared" / "data" / "real"  # ../shared from the repository root
real = pytest.mark.skipif(not (REAL / "processors" / "qwen3_vl" / "vocab.json").is_file(),
                          reason="the real processor files (../shared/data/real/processors) are absent")
CONFIG_7B = "configs/grounding_qwen25vl_7b.yaml"
SERVER_DEFAULT = 8192  # `mmpg vllm-serve --max-model-len`'s default: the length the 7B recipe's prompts outgrew


def _square_video(path: Path, side: int, seconds: float, fps: int = 2) -> Path:
    """An H.264 mp4 of side x side frames (a gradient, so the encoder keeps the size)."""
    import av
    import numpy as np

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"threads": "1", "bf": "0"})
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        ramp = np.linspace(0, 255, side, dtype=np.uint8)
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.stack([np.add.outer(ramp, ramp * 0 + i).astype(np.uint8)] * 3, -1),
                                               format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


@real
@pytest.mark.parametrize("family, video_tokens", [("qwen2_5_vl", 8192), ("qwen3_vl", 6272)])
def test_the_7b_configs_worst_prompt_is_what_its_longest_video_makes(tmp_path, family, video_tokens):
    """configs/grounding_qwen25vl_7b.yaml: 64 frames of at most 200,704 pixels (8,192 tokens of 28² pixels; 6,272 of
    32² for Qwen3-VL's 448² frames). A 40-s 448x448 video decoded by qwen-vl-utils with the config's settings, the
    longest public query (TimeRFT, 126 tokens) in the config's template, through the released processor: its video
    tokens are the bound's exactly, and the whole prompt is at most the worst prompt (which assumes a 128-token query
    and a 4-digit duration) by a few tokens."""
    from mmpg.data.prompts import build_prompt_inputs, get_template
    from mmpg.data.samples import GroundingSample
    from mmpg.data.video import load_video
    from mmpg.models.loading import load_processor

    cfg = load_config(CONFIG_7B, [])
    processor = load_processor(REAL / "processors" / family)
    worst = lengths.worst_prompt(cfg, processor)
    assert (worst.video_tokens, worst.frames, worst.counted) == (video_tokens, 64, True)
    print(f"\n{family}: {worst.describe(cfg.rollout.max_new_tokens)} -> --max-model-len "
          f"{worst.server_len(cfg.rollout.max_new_tokens)}")
    vp = processor.video_processor
    video = load_video(str(_square_video(tmp_path / "v.mp4", 448, 40.0)), lengths.data_spec(cfg, vp.patch_size))
    timerft = REAL / "train_2k5.json"  # TimeRFT: the longest query of the public sets
    query = max((r["sentence"] for r in json.loads(timerft.read_text())), key=len) if timerft.is_file() else \
        "a person opens the door " * 20
    sample = GroundingSample(sample_id="v#0", video=str(tmp_path / "v.mp4"), duration=40.0, query=query,
                             span=(1.0, 2.0))
    ids = build_prompt_inputs(processor, [sample], [video], get_template(cfg.data.template))["input_ids"][0]
    print(f"{family}: a 40-s 448x448 video with the longest TimeRFT query: {len(ids):,} prompt tokens")
    assert len(video.timestamps) == 64 and int((ids == processor.video_token_id).sum()) == video_tokens
    assert 0 <= worst.tokens - len(ids) <= (2 * 32 + 8 if family == "qwen3_vl" else 8), (worst.tokens, len(ids))
    if family == "qwen2_5_vl":  # the blocker: the recipe's prompts do not fit the server's default length
        assert worst.needed(cfg.rollout.max_new_tokens) > SERVER_DEFAULT
        assert worst.server_len(cfg.rollout.max_new_tokens) == 8960


def test_video_tokens_follow_qwen_vl_utils_where_min_pixels_wins():
    """Hand-computed: min 100, max 200, total 1,000 tokens of 784 pixels, 4..64 frames. qwen-vl-utils caps a frame at
    max(min(768·784, total / n · 2), int(1.05 · min)) = 82,320 pixels for n >= 20 (the 1.05 · min floor wins), so
    64 frames make 32 · floor(82,320 / 784) = 32 · 105 = 3,360 tokens, past the 1,000-token total budget."""
    from mmpg.data.video import VideoSpec

    spec = VideoSpec(min_frames=4, max_frames=64, min_pixels=784 * 100, max_pixels=784 * 200, total_pixels=784 * 1000,
                     image_patch_size=14)
    assert lengths.worst_video_tokens(spec) == (3360, 64)
    # an odd cap is floored to even, as smart_nframes does: 7 frames -> 6 (3 temporal patches of 4 tokens)
    assert lengths.worst_video_tokens(VideoSpec(min_frames=2, max_frames=7, min_pixels=3136, max_pixels=3136,
                                                image_patch_size=14)) == (12, 6)


@real
@pytest.mark.parametrize("template", ["time_r1", "time_r1_frames", "answer_only"])
def test_the_estimate_without_a_processor_bounds_the_counted_prompt(template):
    """A checkpoint not on this machine yet: `estimate` (text bounded by its bytes) is at least what the released
    processors count, for either family and for an unknown one."""
    from mmpg.models.loading import load_processor

    cfg = load_config(CONFIG_7B, [f"data.template={template}"])
    for family in ("qwen2_5_vl", "qwen3_vl"):
        counted = lengths.worst_prompt(cfg, load_processor(REAL / "processors" / family))
        for guess in (family, None):
            bound = lengths.estimate(cfg, guess)
            assert bound.video_tokens >= counted.video_tokens and bound.tokens >= counted.tokens, (family, guess)


def _vllm_len(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmpg.cli", "vllm-len", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False, env=dict(os.environ, HF_HUB_OFFLINE="1"))


@real
def test_vllm_len_prints_the_servers_length_for_a_config():
    counted = _vllm_len("--config", CONFIG_7B, f"model.path={REAL / 'processors' / 'qwen2_5_vl'}")
    assert counted.returncode == 0, counted.stderr
    assert counted.stdout.strip() == "8960" and "counted by the model's processor" in counted.stderr
    # as docs/rollouts.md prints it: the config's hub id, counted where its snapshot is cached, else bounded without
    # downloading anything; either way at least the counted length
    as_documented = _vllm_len("--config", CONFIG_7B)
    assert as_documented.returncode == 0, as_documented.stderr
    assert int(as_documented.stdout) >= 8960 and "worst prompt" in as_documented.stderr
    bounded = _vllm_len("--config", CONFIG_7B, "model.path=nobody/Qwen2.5-VL-7B-Instruct")
    assert bounded.returncode == 0, bounded.stderr
    assert int(bounded.stdout) >= 8960 and "bounded without the model's processor" in bounded.stderr


def _launch(tmp_path, config: str, *overrides: str, **env) -> tuple[str | None, dict]:
    """scripts/train_grounding.sh with VLLM=1, a stand-in launcher (it records its environment) and a stand-in
    server (it records its flags): (the server's flags, the trainer's MMPG_VLLM_* environment). The stand-in trainer
    waits for the server to have written them, as the real one waits for its /health: the script stops the server
    when the trainer exits."""
    trainer, server = tmp_path / "deepspeed", tmp_path / "serve"
    for stale in ("server.args", "server.pid", "trainer.env"):
        (tmp_path / stale).unlink(missing_ok=True)
    trainer.write_text(f"#!/bin/sh\nenv | grep '^MMPG_VLLM_' > {tmp_path}/trainer.env\n"
                       f"for i in $(seq 300); do [ -f {tmp_path}/server.pid ] && break; sleep 0.1; done\nexit 0\n")
    server.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/server.args\necho $$ > {tmp_path}/server.tmp\n'
                      f"mv {tmp_path}/server.tmp {tmp_path}/server.pid\nexec sleep 300\n")
    trainer.chmod(0o755)
    server.chmod(0o755)
    e = dict(os.environ, MMPG_EXTRAS="dev", MMPG_DEEPSPEED=str(trainer), MMPG_VLLM_SERVE=str(server), VLLM="1",
             HF_HUB_OFFLINE="1", **env)
    res = subprocess.run(["bash", "scripts/train_grounding.sh", config, *overrides], cwd=ROOT, env=e,
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    args = (tmp_path / "server.args").read_text().strip() if (tmp_path / "server.args").exists() else None
    got = dict(line.split("=", 1) for line in (tmp_path / "trainer.env").read_text().splitlines())
    if args is not None:
        assert got["MMPG_VLLM_PID"] == (tmp_path / "server.pid").read_text().strip()
    assert got["MMPG_VLLM_LOG"] == str(ROOT / "runs" / "vllm-serve-8000.log")
    return args, got


@real
def test_the_launch_gives_the_server_the_configs_length(tmp_path):
    """VLLM=1 on the 7B config: the server gets --max-model-len 8960 (not its default 8192, which the recipe's
    longest prompts outgrow); VLLM_MAX_LEN or VLLM_ARGS' --max-model-len set it instead; the trainer learns the
    server's pid and log."""
    model = f"model.path={(REAL / 'processors' / 'qwen2_5_vl').resolve()}"
    args, _ = _launch(tmp_path, CONFIG_7B, model)
    assert args.endswith("--max-model-len 8960"), args
    args, _ = _launch(tmp_path, CONFIG_7B, model, "rollout.max_new_tokens=1024")
    assert args.endswith("--max-model-len 9728"), args  # 8,440 + 1,024 + 64 -> 9,728
    args, _ = _launch(tmp_path, CONFIG_7B, model, VLLM_MAX_LEN="12345")
    assert args.endswith("--max-model-len 12345"), args
    # the zoom tool: the longest trajectory's length, and the overview and every clip in one request
    args, _ = _launch(tmp_path, CONFIG_7B, model, "data.template=zoom", "zoom.max_turns=2")
    assert args.endswith("--videos-per-prompt 3") and "--max-model-len 8960" not in args, args
    args, _ = _launch(tmp_path, CONFIG_7B, model, VLLM_ARGS="--max-model-len 16384")
    assert args.count("--max-model-len") == 1 and args.endswith("--max-model-len 16384"), args


class _Health(BaseHTTPRequestHandler):
    """A stand-in `mmpg vllm-serve` that answers /health only (any other request: 404)."""

    max_model_len = 0

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"instance": "i0", "version": 0, "max_model_len": self.max_model_len,
                           "wire": WIRE_VERSION,
                           "checkpoint": "/ckpt", "device": "cpu", "nccl": False}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_the_trainer_refuses_a_server_shorter_than_the_configs_worst_prompt(grpo_data, tmp_path):
    """A server of max_model_len 300 and a config whose worst prompt needs more (64 frames of 256 tokens): one error
    line before the first step, exit 2, saying the length to restart it with; nothing trained."""
    from train_utils import overrides, run_cli

    handler = type("Short", (_Health,), {"max_model_len": 300})
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        extra = {"rollout.engine": "vllm", "rollout.vllm_url": f"http://127.0.0.1:{httpd.server_address[1]}",
                 "rollout.vllm_wait_s": 5, "rollout.temperature": 1.0, "data.max_frames": 64,
                 "data.max_pixels": 200704}
        res = run_cli(["train"] + overrides(grpo_data, tmp_path, "short", **extra), timeout=300)
    finally:
        httpd.shutdown()
    assert res.returncode == 2, res.stderr[-3000:]
    line = [x for x in res.stderr.splitlines() if x.startswith("mmpg: error:")]
    assert len(line) == 1 and "has max_model_len 300, below this config's" in line[0], res.stderr[-3000:]
    assert "--max-model-len " in line[0] and "8,192 video tokens at 64 frames" in line[0]
    assert not (tmp_path / "short" / "metrics.jsonl").exists() or not (tmp_path / "short" / "metrics.jsonl").read_text()


def test_check_server_len_passes_at_the_need_and_refuses_below():
    worst = lengths.WorstPrompt(video_tokens=8192, text_tokens=248, frames=64, counted=True)
    lengths.check_server_len(8440 + 256, worst, 256, "http://s")
    lengths.check_server_len(10, None, 256, "http://s")  # a text-only model: nothing to plan
    with pytest.raises(UserError, match=r"max_model_len 8695, below this config's 8,696 .* --max-model-len 8960"):
        lengths.check_server_len(8695, worst, 256, "http://s")


def test_the_zoom_tool_plans_the_servers_length_and_videos(tiny_dirs):
    """data.template=zoom: every turn re-sends the conversation, so the server holds the worst prompt and the longest
    trajectory (zoom.max_turns clips, zoom.max_turns + 1 turns), counted by the processor or bounded without it; and
    it takes 1 + zoom.max_turns videos per prompt, refused in one line otherwise."""
    from mmpg.models.loading import load_processor

    zoom = load_config(None, [f"model.path={tiny_dirs['qwen2_5_vl']}", "data.template=zoom", "zoom.max_turns=2",
                              "zoom.max_frames=8", "rollout.max_new_tokens=32"])
    processor = load_processor(str(tiny_dirs["qwen2_5_vl"]))
    clip = lengths.worst_clip_tokens(zoom, processor)
    assert lengths.response_tokens(zoom, processor) == 2 * clip + 3 * 32
    assert lengths.response_tokens(zoom) >= lengths.response_tokens(zoom, processor)  # the bound holds the count
    one = load_config(None, ["rollout.max_new_tokens=32"])
    assert lengths.response_tokens(one, processor) == 32 and lengths.videos_per_prompt(one) == 1
    # a server too short for the trajectory says what its response counts (not "new tokens" alone)
    worst = lengths.WorstPrompt(video_tokens=100, text_tokens=20, frames=8, counted=True)
    need = lengths.response_tokens(zoom, processor)
    with pytest.raises(UserError, match=rf"\+ {need} tokens of the longest zoom trajectory \(2 clip\(s\) and 3 "
                                        r"turns of rollout.max_new_tokens=32\)\): restart"):
        lengths.check_server_len(120, worst, need, "http://s", lengths.response_words(zoom))
    assert lengths.response_words(one) == "new tokens"
    lengths.check_server_videos(3, zoom, "http://s")
    with pytest.raises(UserError, match=r"takes 1 video\(s\) per prompt; .*zoom.max_turns=2 sends up to 3 .*"
                                        r"--videos-per-prompt 3"):
        lengths.check_server_videos(1, zoom, "http://s")


def test_too_long_prompts_leave_the_batch_as_skips(load_tiny):
    """drop_too_long: the prompts past limit - max_new_tokens leave with a Skip naming them; the rest are the batch
    built from them alone (same ids once re-padded, same videos)."""
    import torch

    from mmpg.data.dataset import GroundingBatch
    from mmpg.data.prompts import build_prompt_inputs
    from mmpg.data.samples import GroundingSample
    from mmpg.data.video import DecodedVideo
    from mmpg.grouping.inputs import pad_token_id
    from mmpg.rl.too_long import drop_too_long

    model, processor = load_tiny("qwen2_5_vl")

    def sample(i, words):
        frames = torch.full((4, 3, 28, 28), 40.0 * i)
        video = DecodedVideo(frames=frames, timestamps=[0.0, 0.5, 1.0, 1.5], sample_fps=2.0,
                             metadata={"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4},
                             path=f"v{i}.mp4", duration=2.0)
        return GroundingSample(sample_id=f"v{i}#0", video=f"v{i}.mp4", duration=2.0, query="a cat jumps " * words,
                               span=(0.0, 1.0), origin=f"ann.json:{i + 1}"), video

    pairs = [sample(0, 1), sample(1, 60), sample(2, 2)]
    samples, videos = [s for s, _ in pairs], [v for _, v in pairs]
    batch = GroundingBatch(samples, videos, build_prompt_inputs(processor, samples, videos), [])
    n = batch.inputs["attention_mask"].sum(dim=1).tolist()
    assert n[1] > max(n[0], n[2]) + 50
    kept, skips = drop_too_long(batch, n[1] - 1 + 8, 8, model, pad_token_id(model))
    assert [s.sample_id for s in kept.samples] == ["v0#0", "v2#0"] and kept.videos == [videos[0], videos[2]]
    assert [s.where for s in skips] == [samples[1].where] and kept.skipped == skips
    assert f"its prompt has {n[1]} tokens; with rollout.max_new_tokens 8" in skips[0].reason
    alone = build_prompt_inputs(processor, [samples[0], samples[2]], [videos[0], videos[2]])
    for key in ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw"):
        assert torch.equal(kept.inputs[key], alone[key]), key
    same, none = drop_too_long(batch, n[1] + 8, 8, model, pad_token_id(model))
    assert same is batch and none == []
    empty, all_three = drop_too_long(batch, 8, 8, model, pad_token_id(model))
    assert len(empty) == 0 and empty.inputs is None and len(all_three) == 3


def _exited_child(tmp_path, lines: str) -> tuple[subprocess.Popen, Path]:
    """A 'server' that writes `lines` to its log and exits; not reaped (a zombie, as the launch script's child is
    while its shell waits on the trainer)."""
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["sh", "-c", f"printf '{lines}'; exit 1"], stdout=out, stderr=subprocess.STDOUT)
    for _ in range(100):
        if Path(f"/proc/{proc.pid}/stat").exists() and \
                Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    return proc, log


def test_a_server_that_exits_ends_the_wait_at_once_with_its_log(tmp_path, monkeypatch):
    """rollout.vllm_wait_s is 300 s, but the launch script's server process is gone: the wait ends within a poll,
    quoting the last lines of its log (where vLLM says why it stopped)."""
    from mmpg.rollout.vllm_wait import wait_for_server

    proc, log = _exited_child(tmp_path, "loading\\nValueError: max_model_len 99999 is past the model limit 8192\\n")
    monkeypatch.setenv("MMPG_VLLM_PID", str(proc.pid))
    monkeypatch.setenv("MMPG_VLLM_LOG", str(log))
    t0 = time.monotonic()
    with pytest.raises(ServerError) as err:
        wait_for_server(f"http://127.0.0.1:{free_port()}", 300.0, poll_s=0.2)
    assert time.monotonic() - t0 < 30
    text = str(err.value)
    assert f"(pid {proc.pid}) exited before it answered" in text and str(log) in text
    assert text.endswith("ends: loading | ValueError: max_model_len 99999 is past the model limit 8192")
    assert "\n" not in text
    proc.wait()


def test_a_server_that_is_late_is_reported_with_its_log(tmp_path):
    from mmpg.rollout.vllm_wait import wait_for_server

    log = tmp_path / "server.log"
    log.write_text("INFO loading weights\n\nINFO compiling graphs\n")
    with subprocess.Popen(["sleep", "30"]) as alive:
        with pytest.raises(ServerError, match=r"waited 0.5 s: rollout.vllm_wait_s\); its log .* ends: INFO loading "
                                              r"weights \| INFO compiling graphs$"):
            wait_for_server(f"http://127.0.0.1:{free_port()}", 0.5, poll_s=0.2, server_pid=alive.pid,
                            server_log=str(log))
        alive.kill()
