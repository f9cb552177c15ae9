"""The rollout level's `vllm` variant: `VLLMEngine.generate_groups` against a `mmpg vllm-serve` beside the HF engine.

    mmpg bench --preset rollout-vllm-cpu                   B 2, G 8, S 32, 8 frames 112x112 (P 102), qwen2_5_vl
    mmpg bench --preset cpu-targets --levels rollout --family qwen2_5_vl --vllm      any rollout config, vllm added
    mmpg bench --preset rollout-vllm-cpu --vllm-url http://127.0.0.1:8000           a server already running

Opt-in: a server start takes 1-3 min on a CPU. Per config that holds the variant, the parent process
(`runner.run_config`, through `start_server`) refuses what vLLM cannot serve as a "skipped: ..." row, never a crash
(`skip_reason`: no .venv-vllm, a family other than qwen2_5_vl, head_dim < 32); saves the config's model (the same
seeded random weights as the other variants, `save_served_model`) or takes --vllm-checkpoint (same architecture,
checked); starts the server on 127.0.0.1 and stops its process group in a finally (its log kept only when anything
failed). --vllm-url skips the saving and the start.
Each worker builds the model on the meta device (the server holds the weights) and times `generate_groups` of the
other variants' B prompts with frames whose patch grid is the prompt's (G responses of exactly S tokens, no stop,
temperature 1). Step k shifts the prompts' first text token and frames by k, so vLLM's prefix and multimodal caches
cannot skip a later step's prefill. Compared: vLLM's kernels, scheduler, HTTP and frame preprocessing in the server's
dtype against transformers + torch in the bench's process; the server's prefill/decode split, K/V and memory are not
seen from here (the row shows - and n/a).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
from pathlib import Path

import torch

from mmpg.serve.launch import ServerStartError

SKIP_NO_VENV = "skipped: no .venv-vllm (bash scripts/env.sh vllm)"
START_TIMEOUT_S = 900.0  # vllm-cpu loads and warms up in 1-3 min here, more while other jobs run
MIN_HEAD_DIM = 32  # vllm-cpu's attention refuses smaller heads (the default tiny size's 16)
CHECKED_FAMILY = "qwen2_5_vl"  # the family whose synthetic bench prompt vLLM expands to the same tokens
SAME_ARCH = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size")


def skip_reason(config: dict, python: str | None = "auto") -> str | None:
    """The "skipped: ..." note of the config's vllm row, or None when it can run. `python`: the .venv-vllm
    interpreter ("auto": `mmpg.serve.launch.vllm_python()`); not needed with config["vllm_url"]."""
    from mmpg.bench.model import model_config

    family = config.get("family")
    if family != CHECKED_FAMILY:
        why = ("mmpg vllm-serve serves video models (vLLM refuses limit_mm_per_prompt for a text model)"
               if family in ("qwen2", "qwen3") else
               "the bench's synthetic prompt has no per-frame timestamps, which vLLM writes from the frames; "
               "VLLMEngine serves processor-made Qwen3-VL prompts (tests/test_vllm_qwen3.py)")
        return f"skipped: vllm variant needs --family qwen2_5_vl ({family}: {why})"
    text = model_config(config)[0].get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if head_dim < MIN_HEAD_DIM:
        return (f"skipped: head_dim {head_dim} < {MIN_HEAD_DIM}, which vLLM's attention refuses (e.g. hidden 256 / "
                "4 heads)")
    if config.get("vllm_checkpoint"):
        mismatch = checkpoint_mismatch(config, config["vllm_checkpoint"])
        if mismatch:
            return f"skipped: --vllm-checkpoint is not the config's model ({mismatch})"
    if config.get("vllm_url"):
        return None
    if python == "auto":
        from mmpg.serve.launch import vllm_python

        python = vllm_python()
    return SKIP_NO_VENV if python is None else None


def checkpoint_mismatch(config: dict, checkpoint: str | Path) -> str | None:
    """'hidden_size 64 vs 256' for the first architecture field where the checkpoint differs from the config's
    model; None when they agree (the weights may differ: only the shapes matter for timing)."""
    from mmpg.bench.model import model_config

    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return f"{path} does not exist"
    theirs = json.loads(path.read_text())
    ours = model_config(config)[0]
    text_theirs, text_ours = theirs.get("text_config", theirs), ours.get_text_config()
    for key in SAME_ARCH:
        mine = getattr(ours, key) if key == "model_type" else getattr(text_ours, key, None)
        other = theirs.get(key) if key == "model_type" else text_theirs.get(key, theirs.get(key))
        if other != mine:
            return f"{key} {other} vs {mine}"
    return None


def save_served_model(config: dict, folder: Path) -> Path:
    """The config's model (seeded as `build_model` seeds every variant's) and the tiny builder's processor, saved
    as a checkpoint vLLM loads like a hub one."""
    from mmpg.bench.model import build_model, set_generation_ids
    from mmpg.toy.models import TinySpec, build_tiny_processor

    model, _ = build_model(config, torch.device("cpu"))
    set_generation_ids(model)
    model.save_pretrained(folder)
    build_tiny_processor(config["family"], TinySpec(**config["spec"]), seed=0).save_pretrained(folder)
    return folder


def start_server(config: dict, P: int, stack: contextlib.ExitStack, log=print) -> tuple[dict | None, str | None]:
    """(the server's facts from `serving`, None), or (None, the vllm row's "skipped: ..." or "error: ..." note); a
    server started here is stopped when `stack` closes."""
    note = skip_reason(config)
    if note is None:
        try:
            return stack.enter_context(serving(config, P, log=log)), None
        except ServerStartError as err:
            note = f"error: {err.line}"
    log(f"  rollout vllm: {note}")
    return None, note


@contextlib.contextmanager
def serving(config: dict, P: int, log=print):
    """Yields {"url", "log", "start_s", "checkpoint"} of a server for the config's model: config["vllm_url"] as is,
    else one started here (see the module docstring) and stopped on the way out. The log is kept when the caller
    sets served["keep_log"] or anything raised; ServerStartError when it does not come up."""
    if config.get("vllm_url"):
        yield {"url": config["vllm_url"], "log": None, "start_s": None, "checkpoint": _served(config)}
        return
    from mmpg.serve.launch import ServerProcess

    fd, log_path = tempfile.mkstemp(prefix="mmpg-bench-vllm-", suffix=".log")
    os.close(fd)
    served, server, ok = {"log": log_path, "keep_log": False}, None, False
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-vllm-") as tmp:
        try:
            checkpoint = config.get("vllm_checkpoint") or save_served_model(config, Path(tmp) / "model")
            served["checkpoint"] = str(config.get("vllm_checkpoint") or "a saved copy of the config's model")
            # UNTESTED on a GPU: there the other variants' workers share it with the server (40 % of its memory)
            gpu = ("--gpu-memory-utilization", "0.4") if torch.cuda.is_available() else ()
            server = ServerProcess(checkpoint, log_path, dtype=config.get("dtype", "float32"),
                                   max_model_len=max(1024, P + config["S"] + 16), eager=not torch.cuda.is_available(),
                                   extra=gpu, env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
            log(f"  vllm: starting a server on {server.url} (log {log_path})")
            served.update(url=server.url, start_s=server.wait(START_TIMEOUT_S))
            log(f"  vllm: server up in {served['start_s']:.0f} s")
            yield served
            ok = not served["keep_log"]
        finally:
            if server is not None:
                server.stop()
            if ok:
                os.unlink(log_path)
            else:
                log(f"  vllm: server log kept at {log_path}")


def _served(config: dict) -> str:
    """The checkpoint the server at config["vllm_url"] serves, checked against the config's model when it is on this
    machine; ServerStartError when there is no server or it serves another architecture."""
    from mmpg.serve.wire import ServerError, call

    url = config["vllm_url"]
    try:
        checkpoint = call(url, "/health", timeout=10, what="a health check")["checkpoint"]
    except ServerError as err:
        raise ServerStartError(f"no vLLM server at --vllm-url {url}: {err}") from None
    mismatch = checkpoint_mismatch(config, checkpoint) if Path(checkpoint).is_dir() else None
    if mismatch:
        raise ServerStartError(f"the server at {url} serves {checkpoint}, not the config's model ({mismatch})")
    return checkpoint


# ---- the worker's side --------------------------------------------------------------------------------------------
def videos_for(prompt: dict, vision_config) -> list[tuple[torch.Tensor, dict]]:
    """Per prompt b, seeded frames [T, 3, H, W] (0..255) whose patch grid is video_grid_thw[b], and their metadata."""
    out = []
    for b, (t, h, w) in enumerate(prompt["video_grid_thw"].tolist()):
        T, H, W = t * vision_config.temporal_patch_size, h * vision_config.patch_size, w * vision_config.patch_size
        frames = torch.randint(0, 256, (T, 3, H, W), generator=torch.Generator().manual_seed(b)).float()
        out.append((frames, {"fps": 2.0, "total_num_frames": T, "frames_indices": list(range(T))}))
    return out


def _fresh(prompt: dict, videos: list, k: int, text_ids: int) -> tuple[dict, list]:
    """Step k's prompts: the first (text) token and the frames shifted by k, so no cache of vLLM's knows them."""
    if k == 0:
        return prompt, videos
    ids = prompt["input_ids"].clone()
    ids[:, 0] = (ids[:, 0] + k) % text_ids
    return dict(prompt, input_ids=ids), [((f + k) % 256, m) for f, m in videos]


def setup(case: dict, device: torch.device):
    """(None, step, info) for the worker: `step()` samples the B groups on the server at case["vllm_url"]."""
    from mmpg.bench.batch import TEXT_IDS, make_batch
    from mmpg.bench.model import build_model

    try:
        from mmpg.rollout import SamplingParams
        from mmpg.rollout.vllm import VLLMEngine
    except Exception as err:  # noqa: BLE001 - any import failure means the engine is not usable here
        raise NotImplementedError(f"mmpg.rollout.vllm not available ({type(err).__name__}: {err})") from None
    if not case.get("vllm_url"):
        raise NotImplementedError("no vLLM server for this case (mmpg.bench.runner.run_config starts one)")
    model, ids = build_model(case, torch.device("meta"))  # config and token ids: the server holds the weights
    prompt, info = make_batch(model, case, ids, torch.device("cpu"))
    videos = videos_for(prompt, model.config.vision_config)
    engine = VLLMEngine(model, ids["tokenizer"], url=case["vllm_url"])
    G, S, B = case["G"], case["S"], prompt["input_ids"].shape[0]
    sampling = SamplingParams(max_new_tokens=S, temperature=1.0, stop_token_ids=(), logprobs=False)
    steps, info["phases"] = itertools.count(), []

    def step():
        inputs, frames = _fresh(prompt, videos, next(steps), TEXT_IDS)
        rollout = engine.generate_groups(inputs, G, sampling, videos=frames)
        lengths = rollout.completion_mask.sum(dim=1)  # [B·G]
        if rollout.completion_ids.shape[0] != B * G or not bool((lengths == S).all()):
            raise RuntimeError(f"vLLM returned {rollout.completion_ids.shape[0]} rows of lengths "
                               f"{sorted(set(lengths.tolist()))}, asked for {B * G} rows of exactly {S} tokens")
        info["phases"].append({"prefill_s": None, "decode_s": None, "kv_bytes": None})  # the server's, unseen

    info["tokens"] = B * (info["P"] + G * S)
    return None, step, info
