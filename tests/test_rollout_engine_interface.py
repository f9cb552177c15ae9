"""One rollout engine interface (`mmpg.rollout.engine.RolloutEngine`): both engines and the bench's stand-in take the
same `generate_groups` arguments, the HF engine has the trivial forms of what a trainer asks besides sampling (nothing
to send, no length limit, no errors of a user's making, no overlap), the vLLM engine its own (checked without a
server), and `GRPOStep` turns an engine's user-facing error into one naming the sample, whichever engine it holds."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types

import pytest

from batches import text_batch, vl_batch
from mmpg.bench.step import GenerateEngine
from mmpg.errors import UserError
from mmpg.rollout import HFEngine, RolloutEngine, SamplingParams
from mmpg.rollout.engine import Rollout
from mmpg.rollout.vllm import PromptTooLongError, VLLMEngine
from mmpg.serve.wire import ServerError


@pytest.mark.parametrize("engine", [HFEngine, VLLMEngine, GenerateEngine], ids=lambda e: e.__name__)
def test_every_engine_takes_the_base_signature(engine):
    base = inspect.signature(RolloutEngine.generate_groups)
    assert list(base.parameters) == ["self", "prompt_inputs", "group_size", "sampling", "prompt_seeds", "videos"]
    assert [p.name for p in base.parameters.values() if p.kind is p.KEYWORD_ONLY] == ["prompt_seeds", "videos"]
    own = inspect.signature(engine.generate_groups)
    assert own == base, f"{engine.__name__}.generate_groups{own}, the interface's generate_groups{base}"
    assert issubclass(engine, RolloutEngine)


def test_the_hf_engine_has_the_trivial_forms(load_tiny):
    model, tokenizer = load_tiny("qwen2")
    engine = HFEngine(model, tokenizer)
    assert engine.sync_weights() == {}  # it samples with the policy itself
    assert engine.max_model_len is None
    assert engine.user_error(ServerError("no vLLM server at x"), ["a.json:1"]) is None  # every error is a bug here
    with pytest.raises(UserError, match=r"HFEngine samples with the trainer's own model.*rollout.max_staleness=0"):
        engine.overlap_updates()
    inputs = text_batch(tokenizer, 2)
    greedy = SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=())
    # the videos are in the inputs: the argument changes nothing
    assert engine.generate_groups(inputs, 2, greedy, videos=["ignored", None]).completion_ids.tolist() == \
        engine.generate_groups(inputs, 2, greedy).completion_ids.tolist()


def _offline_vllm(model=None, processor=None, partitioned=False) -> VLLMEngine:
    """A VLLMEngine without a server: what its constructor would have read from /health."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.model, engine.processor, engine.url = model, processor, "http://127.0.0.1:9"
    engine.urls = [engine.url]
    engine.health, engine.version, engine.partitioned = {"max_model_len": 64, "instance": "i"}, 0, partitioned
    engine.resync_on_restart, engine.banned = True, []
    return engine


def test_the_vllm_engine_forms_without_a_server(monkeypatch):
    import mmpg.rollout.vllm as vllm

    engine = _offline_vllm()
    assert engine.max_model_len == 64
    too_long = PromptTooLongError(1, "prompt 1 has 70 tokens; with max_new_tokens=8 that exceeds the vLLM server's "
                                     "max_model_len 64: restart it with a larger --max-model-len, or use fewer frames")
    assert engine.user_error(too_long, ["ann.json:3", "ann.json:7"]) == (
        "ann.json:7: the prompt has 70 tokens; with max_new_tokens=8 that exceeds the vLLM server's "
        "max_model_len 64: restart it with a larger --max-model-len, or use fewer frames")
    assert engine.user_error(ServerError("no vLLM server at x: start it")) == "no vLLM server at x: start it"
    assert engine.user_error(KeyError("outputs")) is None  # a bug stays a bug
    engine.overlap_updates()
    assert engine.resync_on_restart is False  # a restart mid-update is an error, not a resend
    sent = []
    monkeypatch.setattr(engine, "_send_weights",
                        lambda everything=False, urls=None: sent.append(everything) or {"tensors": 3})
    monkeypatch.setattr(vllm.dist, "rank", lambda: 1)
    assert engine.sync_weights() == {} and sent == []  # not ZeRO-3: rank 0 sends, the others return at once
    engine.partitioned = True
    assert engine.sync_weights() == {"tensors": 3} and sent == [False]  # ZeRO-3: every rank gathers with rank 0


def test_the_vllm_engine_says_when_the_frames_are_missing(load_tiny):
    model, processor = load_tiny("qwen2_5_vl")
    inputs = vl_batch(processor, "qwen2_5_vl", [None, (2, 28, 28)])
    engine = _offline_vllm(model, processor)
    engine.health["max_model_len"] = 10 ** 6
    with pytest.raises(ValueError, match=r"prompt 1 holds a video but no frames were given.*videos=batch.videos"):
        engine.generate_groups(inputs, 2, SamplingParams(max_new_tokens=4))


class _Refusing(RolloutEngine):
    """Raises `error` from generate_groups; words it as vLLM does."""

    def __init__(self, error):
        self.error = error

    def generate_groups(self, prompt_inputs, group_size, sampling=None, *, prompt_seeds=None, videos=None) -> Rollout:
        raise self.error

    def user_error(self, error, prompts=None):
        return VLLMEngine.user_error(self, error, prompts)


def _step(engine):
    from mmpg.rl.grpo import GRPOStep

    step = GRPOStep.__new__(GRPOStep)
    step.rollout_engine, step.cfg = engine, types.SimpleNamespace(rollout=types.SimpleNamespace(n=2))
    step.zoom = None  # one-turn rollouts
    return step


def test_grpo_step_names_the_sample_of_an_engines_refusal():
    samples = [types.SimpleNamespace(where="ann.json:3"), types.SimpleNamespace(where="ann.json:7")]
    batch = types.SimpleNamespace(inputs={}, samples=samples, videos=[None, None])
    too_long = PromptTooLongError(1, "prompt 1 has 70 tokens; ... max_model_len 64")
    with pytest.raises(UserError, match=r"^ann.json:7: the prompt has 70 tokens; \.\.\. max_model_len 64$"):
        _step(_Refusing(too_long))._generate_here(batch, SamplingParams(), [1, 2])
    with pytest.raises(UserError, match="^no vLLM server at x$"):
        _step(_Refusing(ServerError("no vLLM server at x")))._generate_here(batch, SamplingParams(), [1, 2])
    with pytest.raises(KeyError):  # not the user's: raised as it is
        _step(_Refusing(KeyError("outputs")))._generate_here(batch, SamplingParams(), [1, 2])


def test_an_engine_without_a_limit_keeps_the_batch_and_reports_no_too_long():
    batch, info = object(), {}
    assert _step(_Refusing(None))._fit_server(batch, info) is batch and info == {}


def test_the_config_names_the_engine_and_an_hf_run_never_loads_the_vllm_client(tiny_dirs):
    # a fresh process: this file imports the vLLM engine itself
    code = f"""
import sys
import mmpg.rl.trainer
from transformers import AutoModelForCausalLM, AutoTokenizer
from mmpg.config.tree import Config
from mmpg.rollout.build import make_rollout_engine
cfg = Config()
cfg.rollout.decode, cfg.rollout.prefill_chunk, cfg.algorithm.share_videos = "copy", 64, False
path = {str(tiny_dirs["qwen2"])!r}
engine = make_rollout_engine(cfg, AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path))
print(type(engine).__name__, engine.decode, engine.prefill_chunk, engine.share_videos)
print(sorted(m for m in sys.modules if m.startswith(("mmpg.rollout.vllm", "mmpg.serve"))))
cfg.rollout.engine = "sglang"
try:
    make_rollout_engine(cfg, None, None)
except ValueError as e:
    print(e)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines() == ["HFEngine copy 64 False", "[]",
                                       "rollout.engine='sglang'; choose hf or vllm"], res.stdout


def test_weight_files_of_killed_trainers_are_removed_at_the_next_sync(tmp_path):
    """A weight file outlives a trainer killed mid-sync (its `finally` never runs): the next sync removes it once
    its process is gone and it is older than a sync may last; live or recent ones, and other files, stay."""
    import os

    from mmpg.rollout.vllm import WEIGHT_FILE_PREFIX, remove_stale_weight_files

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID no process holds now (reaped)
    now = 1_000_000.0

    def write(name, age_s):
        path = tmp_path / name
        path.write_bytes(b"x")
        os.utime(path, (now - age_s, now - age_s))
        return path

    stale = write(f"{WEIGHT_FILE_PREFIX}{gone.pid}-abc.safetensors", 3600)
    recent = write(f"{WEIGHT_FILE_PREFIX}{gone.pid}-def.safetensors", 60)  # its sync may still be in flight
    alive = write(f"{WEIGHT_FILE_PREFIX}{os.getpid()}-ghi.safetensors", 3600)  # a live trainer's
    unnamed = write(f"{WEIGHT_FILE_PREFIX}jkl.safetensors", 3600)  # no PID in the name: not provably stale
    other = write(f"other-{gone.pid}-x.safetensors", 3600)
    removed = remove_stale_weight_files(str(tmp_path), older_than_s=600, now=now)
    assert removed == [str(stale)]
    assert not stale.exists()
    assert recent.exists() and alive.exists() and unnamed.exists() and other.exists()
    assert remove_stale_weight_files(str(tmp_path / "missing"), now=now) == []  # no folder: nothing to do
