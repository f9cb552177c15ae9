"""perf/peak_memory_mb on the CPU measures what `mmpg plan --device cpu` predicts (`mmpg.train.peak_memory`): the
memory above the process's baseline before the model, without the modules imported after it, and a real
`mmpg train` run of a case the plan was validated on (`mmpg.plan.validate`) lands within the plan's stated error."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from train_utils import env, metrics, run_cli

ROOT = Path(__file__).resolve().parents[1]
MB = 2 ** 20


def test_the_cpu_figure_counts_tensors_above_the_baseline_and_not_imports():
    # a fresh process: the baseline fixes the allocator's threshold and wraps imports, as a CPU run does
    script = textwrap.dedent("""
        import json, torch
        from mmpg.train.engine import prepare_deepspeed_env
        prepare_deepspeed_env("cpu")
        from mmpg.train import peak_memory as pm
        record = pm.start("cpu")
        at_start = pm.peak_memory_mb("cpu")
        x = torch.ones(200 * 2 ** 20 // 4)  # 200 MiB, every page written
        with_tensor = pm.peak_memory_mb("cpu")
        del x
        after_free = pm.peak_memory_mb("cpu")
        before = pm._anon()
        import sympy  # a large package nothing above imported: its objects are code, not the run's data
        grown = pm._anon() - before
        after_import = pm.peak_memory_mb("cpu")
        y = torch.ones(300 * 2 ** 20 // 4)  # a larger peak after the import: counted without the import
        later = pm.peak_memory_mb("cpu")
        print(json.dumps({"record": record, "at_start": at_start, "with_tensor": with_tensor,
                          "after_free": after_free, "import_mb": grown / 2 ** 20, "after_import": after_import,
                          "later": later}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["record"]["measure"] == "cpu.rss_above_baseline" and out["record"]["high_water"] == "VmHWM"
    assert out["record"]["mmap_threshold"] == 1 << 20 and out["record"]["baseline_mb"] > 100  # the default
    assert out["at_start"] < 5  # not the ~1 GB of Python, torch and DeepSpeed
    assert 200 <= out["with_tensor"] <= 210, out  # the tensor, and little besides
    assert out["after_free"] == pytest.approx(out["with_tensor"], abs=1)  # a high-water: it stays
    assert out["import_mb"] > 10, out  # the import did grow the process ...
    assert out["after_import"] == pytest.approx(out["with_tensor"], abs=1), out  # ... it is not the run's,
    assert 300 <= out["later"] <= 310, out  # and the peak before it stays whole, the one after counts without it


# The CPU validation configs: seven cases of the validation grid (docs/performance.md) run as `mmpg train`, one step,
# and configs/cpu_demo.yaml for two steps (docs/plan.md, "A run beside its plan"), each with the perf/peak_memory_mb
# its run logged (a cold `mmpg train` process each, 2026-12-03, 2 busy cores; the slow test below forks its runs from
# a warm process, which has more modules in its baseline and measures 0-12 % lower).
MEASURED_MB = {"tiny-z2-lora0-G16-P8192-nockpt-mmpg": 262.2, "tiny-z0-lora0-G4-P1024-nockpt-naive": 147.6,
               "small-z0-lora0-G16-P8192-nockpt-mmpg": 900.0, "tiny-z0-lora8-G16-P1024-nockpt-mmpg": 55.2,
               "tiny-z2-lora0-G4-P1024-ckpt-mmpg": 40.6, "tiny-z3-lora8-G16-P1024-nockpt-mmpg": 60.4,
               "tiny-z2-lora8-G16-P1024-ckpt-naive": 553.9, "cpu_demo": 42.5}
# run end to end (slow): the grid's largest and its worst-planned case, a naive one and the demo
RUN_CASES = ["tiny-z2-lora0-G16-P8192-nockpt-mmpg", "tiny-z0-lora0-G4-P1024-nockpt-naive",
             "tiny-z3-lora8-G16-P1024-nockpt-mmpg", "cpu_demo"]


def test_the_rollout_cache_is_freed_when_the_rollout_returns():
    """The cascade cache's layers point back at it weakly: no reference cycle keeps the rollout's K/V alive through
    the reference logprobs and the update until Python's cyclic collector happens to run (a small model's P 8k prompt
    held 33 MB over its update that way)."""
    import gc
    import weakref

    from mmpg.rollout.cascade import SharedPrefixCache

    gc.disable()
    try:
        cache = SharedPrefixCache(num_layers=2, capacity=4)
        alive = weakref.ref(cache)
        del cache
        assert alive() is None
    finally:
        gc.enable()


def test_weight_pages_count_what_the_file_backs(tmp_path):
    """A mapped checkpoint's pages are the run's weights while the file backs them; a page the run writes (a trained
    weight) moves to anonymous memory, which the resident set counts already, and must not be counted twice."""
    import mmap

    from mmpg.train import peak_memory as pm

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\1" * (8 * MB))
    with open(path, "r+b") as f:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, as safetensors maps a checkpoint
    before = pm._weight_pages()
    sum(pages[i] for i in range(0, 8 * MB, 4096))  # read: every page resident, backed by the file
    read = pm._weight_pages() - before
    for i in range(0, 8 * MB, 4096):
        pages[i] = 2  # written: each page copied into anonymous memory
    written = pm._weight_pages() - before
    pages.close()
    assert 7.9 * MB <= read <= 8.1 * MB and abs(written) < 0.1 * MB, (read / MB, written / MB)


def _plan_config(name: str, models: dict, root: Path):
    """The case's resolved config, as its run would write it."""
    from mmpg.config import load_config
    from mmpg.plan.validate import grid

    if name == "cpu_demo":
        return load_config(str(ROOT / "configs" / "cpu_demo.yaml"), [f"model.path={models['demo']}"])
    case = {c["name"]: c for c in grid()}[name]
    return load_config(None, _run_overrides(case, str(models[case["model"]]), root, root))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The validation grid's tiny and small checkpoints and the demo's (random weights: only their sizes matter)."""
    from mmpg.plan.validate import MODELS
    from mmpg.toy.demo.pipeline import FAMILY, MODEL_SIZE
    from mmpg.toy.models import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("models")
    sizes = dict(MODELS, demo=MODEL_SIZE)
    return {name: make_tiny(FAMILY, root / name, seed=0, spec=TinySpec(**spec)) for name, spec in sizes.items()}


@pytest.mark.parametrize("name", list(MEASURED_MB))
def test_the_cpu_plan_holds_its_validation_runs(name, models, tmp_path):
    """`mmpg plan --device cpu` on each CPU validation config against the peak its run logged: within the plan's
    stated error (CPU_STATED_ERROR, ±23.5 %). The plan without its CPU terms is outside it on two of these figures
    (the naive case under checkpointing x1.35, the demo x1.41); with the run's earlier measure four were (x1.40,
    x1.41, x1.65, x1.96)."""
    from mmpg.plan.memory import predict
    from mmpg.plan.recipe import recipe_from_config
    from mmpg.plan.run import CPU_STATED_ERROR

    planned = predict(recipe_from_config(_plan_config(name, models, tmp_path), 1, "cpu"))["peak_bytes"] / MB
    assert abs(MEASURED_MB[name] / planned - 1) <= CPU_STATED_ERROR, (planned, MEASURED_MB[name])


def _run_overrides(case: dict, model: str, synth: Path, out: Path) -> list[str]:
    """The case as a training config: one prompt of ~P tokens (P / 32 frames of 224 x 224: 32 video tokens a
    frame), G responses of up to S tokens, its ZeRO stage, LoRA, checkpointing and layout."""
    grouped = case["variant"] != "naive"
    return [f"{k}={v}" for k, v in {
        "model.path": model, "model.dtype": case["dtype"], "model.freeze_vision": case["freeze_vision"],
        "model.lora.r": case["lora_r"], "model.gradient_checkpointing": case["grad_ckpt"],
        "data.train": synth / "train.json", "data.videos": synth / "videos", "data.batch_size": 1,
        "data.fps": 2.0, "data.max_frames": case["P"] // 32, "data.min_pixels": 224 * 224,
        "data.max_pixels": 224 * 224, "data.num_workers": 1,
        "rollout.n": case["G"], "rollout.max_new_tokens": case["S"], "rollout.decode": "cascade" if grouped else "copy",
        "algorithm.grouping": grouped, "algorithm.beta": case["beta"], "algorithm.self_check": case["self_check"],
        "deepspeed.zero_stage": case["zero"], "trainer.micro_batch_size": case["G"], "trainer.device": "cpu",
        "trainer.output_dir": out, "trainer.run_name": case["name"], "trainer.total_steps": 1, "trainer.seed": 0,
        "checkpoint.every_n_steps": 0, "eval.every_n_steps": 0, "logging.tensorboard": False,
        "reward.function": "reward_fns:digit_share"}.items()]


@pytest.fixture(scope="module")
def long_videos(tmp_path_factory):
    """Videos long enough for 256 frames at 2 fps, 224 x 224 (the validation cases' P 8192)."""
    from mmpg.toy.videos import generate_dataset

    root = tmp_path_factory.mktemp("long_videos")
    generate_dataset(root / "synth", 4, 0, overwrite=True, min_duration=130.0, max_duration=140.0,
                     sizes=((224, 224),), fps_choices=(2.0,), splits=(0.5, 0.25, 0.25))
    return root / "synth"


@pytest.fixture(scope="module")
def easy_videos(tmp_path_factory):
    """A few of the demo's easy videos (configs/cpu_demo.yaml's data: 28 x 28 frames at 2 fps, 8-20 s)."""
    from mmpg.toy.demo.pipeline import MAX_DURATION, MIN_DURATION
    from mmpg.toy.videos import generate_dataset

    root = tmp_path_factory.mktemp("easy_videos") / "easy"
    generate_dataset(root, n=24, seed=0, overwrite=True, min_duration=MIN_DURATION, max_duration=MAX_DURATION,
                     easy=True)
    return root


def _demo_overrides(model: str, easy: Path, out: Path) -> list[str]:
    """configs/cpu_demo.yaml for two steps, on the fixture's videos, without checkpoints or evaluation."""
    return ["--config", str(ROOT / "configs" / "cpu_demo.yaml"), f"model.path={model}",
            f"data.train={easy / 'train.json'}", f"data.val={easy / 'val.json'}", f"data.videos={easy / 'videos'}",
            "trainer.total_steps=2", f"trainer.output_dir={out}", "trainer.run_name=cpu_demo", "trainer.seed=0",
            "checkpoint.every_n_steps=0", "checkpoint.resume=", "eval.every_n_steps=0"]


@pytest.mark.slow  # 15-45 s a case on 2 busy cores
@pytest.mark.parametrize("name", RUN_CASES)
def test_a_run_measures_what_its_plan_predicts(name, models, long_videos, easy_videos, tmp_path):
    from mmpg.plan.run import CPU_STATED_ERROR, inspect_plan
    from mmpg.plan.validate import grid
    from mmpg.runs import RunReader

    if name == "cpu_demo":
        args, S = _demo_overrides(str(models["demo"]), easy_videos, tmp_path), 24
    else:
        case = {c["name"]: c for c in grid()}[name]  # a case the plan was validated on
        args, S = _run_overrides(case, str(models[case["model"]]), long_videos, tmp_path), case["S"]
    # the validation's allocator setting (mmpg.train.peak_memory: a run's default, 1 MiB, adds the heap's slack)
    proc = run_cli(["train"] + args, timeout=600, environ={**env(), "MALLOC_MMAP_THRESHOLD_": str(64 << 10)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / name
    reader = RunReader(run)
    info = reader.info()
    assert info["peak_memory"]["measure"] == "cpu.rss_above_baseline" and info["peak_memory"]["from_step"] == 1
    assert info["peak_memory"]["mmap_threshold"] == 64 << 10  # the validation's allocator setting
    assert metrics(run)[0]["response/length_mean"] > 0.9 * S  # the plan's S: responses near full length
    p = inspect_plan(str(run), info, reader.metrics())
    planned, measured = p["peak_bytes"] / MB, p["measured_peak_mb"]
    print(f"{name}: planned {planned:.1f} MB, measured {measured:.1f} MB, x{measured / planned:.2f}")
    assert p["comparable"] and abs(measured / planned - 1) <= CPU_STATED_ERROR, (planned, measured)
