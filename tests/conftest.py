"""Session fixtures: tiny checkpoints of every family saved and loaded through `from_pretrained`, and helpers to
build processor batches. Everything is built offline in a temporary folder; nothing is downloaded."""

from __future__ import annotations

import os

os.environ.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a hub id in a test is read from a cache the test builds, never fetched

import pytest
import torch

from mmpg.toy.models import make_tiny


# The modules that take the shared vLLM server (`qwen25_vllm`): scripts/test.sh's xdist workers run them as one unit,
# on one worker, so the server starts once per run instead of once per worker (~40 s each on 2 cores).
SHARED_SERVER_MODULES = ("test_vllm_engine.py", "test_vllm_lora.py", "test_vllm_overlap.py",
                         "test_vllm_video_once.py", "test_vllm_gpu.py", "test_vllm_concurrent.py",
                         "test_vllm_pool.py")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class SharedServerUnit(LoadFileScheduling):
        def _split_scope(self, nodeid):
            module = super()._split_scope(nodeid)
            return "shared vLLM server" if module.rsplit("/", 1)[-1] in SHARED_SERVER_MODULES else module

    return SharedServerUnit(config, log) if config.getoption("dist") == "loadfile" else None


def pytest_collection_modifyitems(config, items):
    strays = sorted({item.path.name for item in items if "qwen25_vllm" in getattr(item, "fixturenames", ())}
                    - set(SHARED_SERVER_MODULES))
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: add {strays} to SHARED_SERVER_MODULES (they use qwen25_vllm)")
    # a test that stops the shared server goes last: before another module it would cost a second start (~40 s)
    items.sort(key=lambda item: "stops_server" in item.keywords)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> folder of a tiny checkpoint (model + processor) written by `make_tiny`."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny(f, root / f, seed=0) for f in ("qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def load_tiny(tiny_dirs):
    """load_tiny(family, dtype=float32) -> (model, processor), loaded as a user loads a hub checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    def load(family, dtype=torch.float32):
        path = tiny_dirs[family]
        if family in ("qwen2", "qwen3"):
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype), AutoProcessor.from_pretrained(path)

    return load


@pytest.fixture(scope="session")
def grpo_data(tiny_dirs, tmp_path_factory):
    """A tiny Qwen2.5-VL checkpoint and 8 short synthetic videos (6 train / 1 val / 1 test) for training tests."""
    from mmpg.toy.videos import generate_dataset

    root = tmp_path_factory.mktemp("grpo_data")
    generate_dataset(root / "synth", 8, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
    return {"model": str(tiny_dirs["qwen2_5_vl"]), "synth": root / "synth"}


@pytest.fixture(scope="session")
def zoom_data(tmp_path_factory):
    """The zoom task (`mmpg synth --zoom`) at 24-second videos: 4 videos (3 train, 1 test) and the rule policy's
    trajectories.jsonl, for the multi-turn tests."""
    from mmpg.toy.zoom_task import ZoomTask, write_zoom_dataset

    root = tmp_path_factory.mktemp("zoom_data")
    write_zoom_dataset(root / "zoom", 4, seed=2, task=ZoomTask(duration=24.0))
    return root / "zoom"


@pytest.fixture(scope="session")
def step_process():
    """The bench's step level in this process (tests/test_bench.py, tests/test_lora_bench.py): dist.init /
    prepare_deepspeed_env set a process group and environment variables for the process; they stay for every test
    that asks (DeepSpeed keeps the first group it saw: a second init after a shutdown is refused) and are undone at
    the end of the session."""
    import os

    from mmpg import dist

    touched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")
    saved = {k: os.environ.get(k) for k in touched}
    was_initialized = torch.distributed.is_initialized()
    yield
    if not was_initialized:
        dist.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def qwen25_vllm(tmp_path_factory):
    """The tiny Qwen2.5-VL checkpoint vLLM can serve and one `mmpg vllm-serve` for it, shared by the vllm test modules
    (`vllm_server.SharedServer`); they take it through the module fixtures `vllm_ckpt` and `server`."""
    from vllm_server import SharedServer, tiny_vllm_checkpoint

    shared = SharedServer(tiny_vllm_checkpoint("qwen2_5_vl", tmp_path_factory),
                          tmp_path_factory.mktemp("vllm_log") / "server.log", "Qwen2.5-VL")
    yield shared
    shared.stop()


@pytest.fixture(scope="module")
def vllm_ckpt(qwen25_vllm):
    """The tiny Qwen2.5-VL checkpoint the shared vLLM server serves (head_dim 64)."""
    return qwen25_vllm.checkpoint


@pytest.fixture(scope="module")
def server(qwen25_vllm):
    """The shared vLLM server, up and holding `vllm_ckpt`'s weights (version 0) when a module starts."""
    return qwen25_vllm.fresh()
