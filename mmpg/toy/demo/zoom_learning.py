"""Does zooming beat one look at an equal frame budget? The toy zoom task's two arms, each a supervised warm start then
GRPO, with a greedy evaluation on the held-out test videos after each stage, printed as one table (the zoom arm's
rows also give the share of test videos whose first call is the rule policy's window, and how many distinct windows
the first turns called, and its SFT rows the answer readout of `mmpg.toy.zoom_readout` on the first 200 test videos'
rule trajectories: the start's units and tenths digits' loss, the share of starts right, the last layer's attention
rank of the clip's flash pair).

    bash scripts/zoom_learning.sh [--unlisted-steps 500] [--clip-steps 0] [--answer-steps 0] [--sft-steps 4500]
                                  [--one-look-sft-steps N]
                                  [--grpo-steps 80] [--test-samples 0] [--videos 3000] [--seed 0] [--workdir DIR]
                                  [--arm both|zoom|one_look]
    bash scripts/zoom_learning.sh --readout CHECKPOINT [CHECKPOINT ...] [--test-samples N]

The task (`mmpg synth --zoom --zoom-rule stamps`, docs/data.md): 120-s videos in which a 0.5-s white flash sits
inside a coloured square's 6-8 s, placed between the frames of an overview at 0.25 fps (30 frames), so the overview
shows the square but never the flash; the zoom tool returns a window at 2.5 fps (at most 64 frames). The rule
policy's window runs between the times the prompt writes before the overview's frame pairs around the square (so the
call copies two numbers of the prompt). The model: a tiny Qwen3-VL (LM hidden 128, 4 layers: 0.95 M parameters; its
vision tower random and frozen), frames 32 x 32 (one token per two).

- zoom arm: SFT on the rule policy's trajectories (`trajectories.jsonl`: overview -> a zoom on a window holding the
  flash -> the answer copied from the times written before the clip's frames), the rule's window and 3 more moved
  along each training video (`--zoom-windows 4`: more clips for the answer; their calls, drawn knowing the flash,
  out of the loss); the 4 trajectories of a video side by side in a step (`data.queries_per_video 4`), so the
  grouped forward encodes and forwards its overview once for all four. Its first `--unlisted-steps` leave the
  tool's schema out of the system turn (`sft.list_tools false`): trained from random, this model does not learn to
  read the overview behind any system turn, and once it reads it, it goes on reading it behind the schema
  (docs/performance.md, ninth attempt). That first stage trains the first turn alone: the rule's trajectory of
  each training video with its answer turn out of the loss (`trajectories-first-turn.jsonl`, weight 0), 8 videos a
  step. With the answer turns in the loss the call stayed one window for every test video after 1000 steps; with
  the call alone, 139 of 200 test calls were the rule's after 500 (tenth attempt). It is evaluated behind its own
  prompt (`zoom_list_tools=false`). `--clip-steps` (default 0: none) then train the answer on the clip alone: one
  look at each trajectory's window at the zoom's frame rate, the answer the rule copied as the span
  (`clips-answers.jsonl`, 8 clips a step), the task the fifth attempt's probe learned from random; evaluated as one
  look at each test video's rule window against the true span (`test-clips.jsonl`). `--answer-steps` (default 0:
  none) then train the answer turn alone, as the
  first stage trained the call: every trajectory (all 4 windows) with its call at weight 0
  (`trajectories-answers.jsonl`), 8 videos a step, behind the prompt rollouts write (after the first-turn stage and
  4,000 whole-trajectory steps the answer is still not read off the clip: docs/performance.md, eleventh and twelfth
  attempts). The rest train whole trajectories behind the prompt rollouts and `mmpg eval` write. Then GRPO
  with the tool (`data.template zoom`, up to `zoom.max_turns` 2 zooms, 128 new tokens a turn, an error turn costs
  0.2).
- one-look arm: the same videos at 0.65 fps, 78 frames: at least the zoom arm's budget (the overview's 30 frames and
  the rule's clips, 46.5 frames on average over the test videos); SFT on the true spans, then GRPO.

Both arms: seed `--seed`, `configs/sft_cpu_demo.yaml`'s optimizer (lr 1e-3, constant), answers with one decimal;
`configs/cpu_demo.yaml`'s GRPO (G 8, temperature 0.7, lr 2e-4) on 4 prompts a step. Each stage's run has a fixed name
and `checkpoint.resume: auto`: run the command again after a stop and it continues (a finished stage and a finished
evaluation are reused); the runs and results of each model, task, seed and first stages have their own folder,
WORKDIR/experiments/<model>-<task>-seed<seed>-first<unlisted steps>[-clips<C>][-answer<answer steps>]/ (runs/,
results/summary.md and summary.json, written atomically), so that no stage resumes another experiment's run. The data's frames are cached
on disk (`data.frame_cache`) after their first decode. `--arm zoom` and `--arm one_look` run one arm each, so that two
processes can train the arms at once in the same WORKDIR (the first to start builds the model and videos, the other
waits for them); each prints its rows, and a run of both arms afterwards reuses their stages and evaluations and writes
the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from mmpg.errors import UserError
from mmpg.toy.demo.pipeline import eval_out, train_stage
from mmpg.toy.zoom_task import ZoomTask

FAMILY = "qwen3_vl"
MODEL_SIZE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
TASK = ZoomTask(duration=120.0, overview_fps=0.25, zoom_fps=2.5, zoom_max_frames=64, window_rule="stamps")
DATA_SEED, WINDOWS = 2, 4
FIRST_TURN_FILE = "trajectories-first-turn.jsonl"  # the rule's trajectory of each training video, its call alone in the loss
ANSWER_FILE = "trajectories-answers.jsonl"  # every trajectory, its answer alone in the loss
CLIP_FILE = "clips-answers.jsonl"  # every trajectory's clip as one look at its window, the copied answer as the span
TEST_CLIP_FILE = "test-clips.jsonl"  # each test video's rule window as one look at it, the true span
PIXELS = 3136  # min = max pixels: Qwen3-VL's 32 x 32 frames, one video token per two frames
ONE_LOOK = {"fps": 0.65, "max_frames": 78}  # >= the zoom arm's budget: overview 30 + the rule's clips (46.5 on average)
MAX_TURNS = 2
NEW_TOKENS = 128  # per model turn (a zoom call is about 70 tokens of the tiny tokenizer)
DECIMALS = 1
WORKDIR = "data/generated/zoom_learning"
ARMS = ("both", "zoom", "one_look")  # --arm: both, or one arm's stages alone
READOUT = (200, 48)  # test videos teacher-forced by the zoom SFT stages' readout, and of them those whose attention


@dataclasses.dataclass(frozen=True)
class Plan:
    sft_steps: int
    one_look_sft_steps: int
    grpo_steps: int
    test_samples: int  # 0: the whole test split
    videos: int
    seed: int
    unlisted_steps: int = 0  # the zoom arm's SFT steps before sft_steps, the tool's schema out of the prompt
    arm: str = "both"  # or "zoom" / "one_look": only that arm's stages, no comparison written
    answer_steps: int = 0  # the zoom arm's SFT steps of answer turns alone, after the unlisted ones
    clip_steps: int = 0  # the zoom arm's SFT steps of answers read off the clip alone, after the unlisted ones


@dataclasses.dataclass
class Paths:
    workdir: Path
    model: Path
    data: Path
    runs: Path
    frames: Path
    results: Path

    @classmethod
    def under(cls, workdir: Path, videos: int, seed: int, unlisted_steps: int = 0, answer_steps: int = 0,
              clip_steps: int = 0) -> Paths:
        """The folders of one experiment: another model size, task, training seed or count of first-turn steps gets
        its own (so that a stage's run is never resumed from another experiment's: the zoom SFT continues the
        first-turn stage's checkpoint), the decoded frames are shared (keyed by file and spec). The first stage's
        name says its data: `-first<N>`, N steps of first turns alone (before, `-unlisted<N>` folders trained whole
        trajectories there, and are not resumed as this stage); `-clips<C>`: then C steps of answers read off the
        clip alone; `-answer<M>`: then M steps of answer turns alone."""
        w = workdir.resolve()
        model = f"tiny-{FAMILY}-{MODEL_SIZE['hidden_size']}x{MODEL_SIZE['num_layers']}"  # the name says the size
        data = f"zoom-{videos}-seed{DATA_SEED}-{TASK.window_rule}-{TASK.zoom_fps:g}fps"
        experiment = w / "experiments" / (f"{model}-{data}-seed{seed}"
                                          + (f"-first{unlisted_steps}" if unlisted_steps else "")
                                          + (f"-clips{clip_steps}" if clip_steps else "")
                                          + (f"-answer{answer_steps}" if answer_steps else ""))
        return cls(w, w / model, w / data, experiment / "runs", w / "frames", experiment / "results")


def ensure_artifacts(paths: Paths, videos: int) -> list[str]:
    """The tiny checkpoint and the task's videos and trajectories, built when missing (under a lock on the workdir,
    so that a second process running the other arm waits for them); returns what was built."""
    import fcntl

    paths.workdir.mkdir(parents=True, exist_ok=True)
    with open(paths.workdir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(paths, videos)


def _build(paths: Paths, videos: int) -> list[str]:
    from mmpg.toy.models import TinySpec, make_tiny
    from mmpg.toy.zoom_task import write_zoom_dataset

    built = []
    if not (paths.model / "model.safetensors").is_file():
        make_tiny(FAMILY, paths.model, seed=0, spec=TinySpec(**MODEL_SIZE), overwrite=True)
        built.append(f"tiny {FAMILY} checkpoint")
    if not (paths.data / "trajectories.jsonl").is_file():
        write_zoom_dataset(paths.data, videos, seed=DATA_SEED, task=TASK, overwrite=True, windows=WINDOWS)
        built.append(f"{videos} zoom-task videos")
    if not (paths.data / FIRST_TURN_FILE).is_file():
        n = write_first_turns(paths.data / "trajectories.jsonl", paths.data / FIRST_TURN_FILE)
        built.append(f"{n} first-turn trajectories")
    if not (paths.data / ANSWER_FILE).is_file():
        n = write_answer_turns(paths.data / "trajectories.jsonl", paths.data / ANSWER_FILE)
        built.append(f"{n} answer-turn trajectories")
    if not (paths.data / CLIP_FILE).is_file():
        n = write_clip_answers(paths.data / "trajectories.jsonl", paths.data / CLIP_FILE)
        built.append(f"{n} clips with their copied answers")
    if not (paths.data / TEST_CLIP_FILE).is_file():
        n = write_test_clips(paths.data, videos, paths.data / TEST_CLIP_FILE)
        built.append(f"{n} test clips")
    return built


def _rewrite_trajectories(src: Path, dst: Path, edit) -> int:
    """The trajectories of `src` that `edit(record)` keeps (it returns the record to write, e.g. its weights changed
    or another JSONL record made from it, or None to leave it out), written atomically to `dst`; returns how many."""
    import json

    from mmpg.runs import atomic_write_text

    kept = []
    for line in src.read_text(encoding="utf-8").splitlines():
        record = edit(json.loads(line)) if line.strip() else None
        if record is not None:
            kept.append(json.dumps(record) + "\n")
    atomic_write_text(dst, "".join(kept))
    return len(kept)


def write_first_turns(src: Path, dst: Path) -> int:
    """The rule's trajectory of each video (those whose call is in the loss; the shifted windows' calls have weight
    0) with every turn after the call at weight 0 (forwarded, not in the loss), written atomically to `dst`;
    returns how many."""

    def first_turn(record):
        if record["messages"][0].get("weight", 1) == 0:
            return None
        for message in record["messages"][1:]:
            if message["role"] == "assistant":
                message["weight"] = 0
        return record

    return _rewrite_trajectories(src, dst, first_turn)


def write_answer_turns(src: Path, dst: Path) -> int:
    """Every trajectory of `src` (the rule's window and the shifted ones) with its call at weight 0 (forwarded, not
    in the loss), so that the loss covers the answer turns alone; written atomically to `dst`; returns how many."""

    def answers(record):
        record["messages"][0]["weight"] = 0
        return record

    return _rewrite_trajectories(src, dst, answers)


def write_clip_answers(src: Path, dst: Path) -> int:
    """Every trajectory of `src` whose clip shows the flash as a one-look sample of its window (JSONL: the video, its
    duration, the query, `clip` = the zoom's window, `span` = the answer the rule copied from the clip's written
    times), so that the answer is learned from the clip alone, as the fifth attempt's probe learned it
    (docs/performance.md); written atomically to `dst`; returns how many."""
    from mmpg.toy.zoom_task import SEEN

    def clip(record):
        if not record["messages"][-1]["content"].startswith(f"<think>{SEEN}</think>"):
            return None
        return {"video": record["video"], "duration": TASK.duration, "query": record["query"],
                "span": record["answer"], "clip": record["window"]}

    return _rewrite_trajectories(src, dst, clip)


def write_test_clips(data: Path, videos: int, dst: Path) -> int:
    """Each test video's rule window as a one-look sample (`clip` = the rule's window, `span` = the true flash):
    the test the clip stage is evaluated on; written atomically to `dst`; returns how many."""
    import json

    from mmpg.runs import atomic_write_text
    from mmpg.toy.zoom_task import QUERY, rule_window, zoom_scenes

    test = json.loads((data / "test.json").read_text(encoding="utf-8"))
    lines = [json.dumps({"video": f"videos/{scene.video_id}.mp4", "duration": TASK.duration, "query": QUERY,
                         "span": [scene.events[1].start, scene.events[1].end],
                         "clip": list(rule_window(scene, TASK))}) + "\n"
             for scene in zoom_scenes(videos, DATA_SEED, TASK) if scene.video_id in test]
    atomic_write_text(dst, "".join(lines))
    return len(lines)


def _common(paths: Paths, seed: int, steps: int, run: str, every: int) -> list[str]:
    return [f"data.min_pixels={PIXELS}", f"data.max_pixels={PIXELS}", "data.val=", f"data.frame_cache={paths.frames}",
            f"trainer.output_dir={paths.runs}", f"trainer.run_name={run}", f"trainer.total_steps={steps}",
            f"trainer.seed={seed}", f"checkpoint.every_n_steps={every}", "checkpoint.keep_last=1",
            "checkpoint.resume=auto", "eval.every_n_steps=0"]


def _zoom() -> list[str]:
    return ["data.template=zoom", f"data.fps={TASK.overview_fps:g}", "data.max_frames=768",
            f"zoom.fps={TASK.zoom_fps:g}", f"zoom.max_frames={TASK.zoom_max_frames}", f"zoom.max_turns={MAX_TURNS}"]


def stage_overrides(paths: Paths, arm: str, kind: str, model: Path, steps: int, seed: int) -> list[str]:
    """The config overrides of one stage (`kind` sft, sft-unlisted: SFT of the first turn without the tool's schema
    in the prompt, sft-clips: SFT of the answer on the clip alone, sft-answer: SFT of the answer turn alone, or grpo)
    of one arm (zoom or one_look)."""
    from mmpg.toy.zoom_task import SEEN

    every = max(1, min(250, steps))  # a stopped stage loses at most 250 steps
    over = [f"model.path={model}", *_common(paths, seed, steps, f"{arm}-{kind}", every)]
    if kind == "sft-clips":  # one look at the zoom's window at the zoom's frame rate, the rule's copied answer
        return over + ["data.template=time_r1", f"data.fps={TASK.zoom_fps:g}",
                       f"data.max_frames={TASK.zoom_max_frames}", f"sft.decimals={DECIMALS}", f"sft.think={SEEN}",
                       "data.num_workers=1", f"data.train={paths.data / CLIP_FILE}", f"data.videos={paths.data}"]
    if arm == "zoom":
        over += _zoom()
    else:
        over += ["data.template=time_r1", f"data.fps={ONE_LOOK['fps']:g}", f"data.max_frames={ONE_LOOK['max_frames']}"]
    if kind.startswith("sft"):
        over += [f"sft.decimals={DECIMALS}", "data.num_workers=1"]
        if kind == "sft-unlisted":
            over += ["sft.list_tools=false"]
        if arm == "zoom":  # the trajectories' video paths are relative to the dataset's folder
            # the unlisted stage: the rule's first turns, 8 videos a step; the answer stage: answer turns, 8 videos
            # a step; then a video's 4 windows side by side
            file, per_video = {"sft-unlisted": (FIRST_TURN_FILE, 1), "sft-answer": (ANSWER_FILE, 1)}.get(
                kind, ("trajectories.jsonl", WINDOWS))
            over += ["data.train=", f"data.videos={paths.data}", f"sft.trajectories={paths.data / file}",
                     f"data.queries_per_video={per_video}", f"trainer.micro_batch_size={WINDOWS}"]
        else:
            over += [f"data.train={paths.data / 'train.json'}", f"data.videos={paths.data / 'videos'}"]
    else:
        over += [f"data.train={paths.data / 'train.json'}", f"data.videos={paths.data / 'videos'}",
                 "data.batch_size=4", f"rollout.max_new_tokens={NEW_TOKENS}"]
        if arm == "zoom":
            over += ["zoom.error_penalty=0.2"]
    return over


def _finished(run: Path, steps: int) -> Path | None:
    from mmpg.runs import list_checkpoints

    ckpts = list_checkpoints(run) if run.is_dir() else []
    return ckpts[-1][1] if ckpts and ckpts[-1][0] >= steps else None


def run_stage(paths: Paths, arm: str, kind: str, model: Path, steps: int, seed: int) -> Path:
    """Train one stage (or continue it after a stop, or reuse it when finished); returns its last checkpoint."""
    run = paths.runs / f"{arm}-{kind}"
    done = _finished(run, steps)
    if done is not None:
        print(f"  {arm} {kind}: reused {done}", flush=True)
        return done
    print(f"  {arm} {kind} ({steps} steps) -> {run}", flush=True)
    sft = kind.startswith("sft")
    config = "sft_cpu_demo.yaml" if sft else "cpu_demo.yaml"
    train_stage("sft" if sft else "train", config, stage_overrides(paths, arm, kind, model, steps, seed),
                run, steps, paths.results / f"{arm}-{kind}.log", every=max(1, steps // 10))
    done = _finished(run, steps)
    if done is None:
        raise UserError(f"{run}: the stage ended without its step-{steps} checkpoint")
    return done


def stage_seconds(run: Path) -> float:
    """A stage's training time: the sum of its steps' `timing_s/step` in the run's metrics.jsonl, each step once (a
    resumed run's repeated step counts its last record), so that a stage trained by an earlier process, or reused,
    reports the time it took."""
    import json

    per_step = {}
    path = run / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        record = json.loads(line) if line.strip() else {}
        if "step" in record and "timing_s/step" in record:
            per_step[record["step"]] = float(record["timing_s/step"])
    return sum(per_step.values())


def evaluate(checkpoint: Path, paths: Paths, arm: str, test_samples: int, listed: bool = True, clips: bool = False):
    """Greedy evaluation on the test split (the zoom protocol for the zoom arm; `listed` false: behind the prompt
    without the tool's schema that the unlisted SFT stage trained on; `clips`: one look at each test video's rule
    window at the zoom's frame rate, the clip stage's own task) into the checkpoint's evals/test folder; a finished
    one with the same settings is reused."""
    from mmpg.eval.runner import evaluate_checkpoint
    from mmpg.eval.settings import load_settings

    common = [f"min_pixels={PIXELS}", f"max_pixels={PIXELS}", f"max_new_tokens={NEW_TOKENS}",
              f"max_samples={test_samples}", "device=cpu", "num_workers=1"]
    if clips:
        own = ["template=time_r1", f"fps={TASK.zoom_fps:g}", f"max_frames={TASK.zoom_max_frames}"]
        settings = load_settings("default", own + common)
        return evaluate_checkpoint(checkpoint, paths.data / TEST_CLIP_FILE, paths.data, eval_out(checkpoint),
                                   settings, benchmark="test")
    if arm == "zoom":
        own = ["template=zoom", f"fps={TASK.overview_fps:g}", "max_frames=768", f"zoom_fps={TASK.zoom_fps:g}",
               f"zoom_max_frames={TASK.zoom_max_frames}", f"zoom_max_turns={MAX_TURNS}",
               f"zoom_list_tools={str(listed).lower()}"]
    else:
        own = ["template=time_r1", f"fps={ONE_LOOK['fps']:g}", f"max_frames={ONE_LOOK['max_frames']}"]
    settings = load_settings("default", own + common)
    return evaluate_checkpoint(checkpoint, paths.data / "test.json", paths.data / "videos", eval_out(checkpoint),
                               settings, benchmark="test")


def answer_readout(checkpoint: Path, test_samples: int) -> dict:
    """The zoom checkpoint's answer readout (`mmpg.toy.zoom_readout`: the answer turn's loss on the start's digits,
    the share of starts right, the last layer's attention on the clip's flash pair) on the first READOUT test videos'
    rule trajectories (at most --test-samples), behind the prompt its run trained on; kept in RUN/evals/readout/
    step_N.json and reused with the same counts."""
    import json

    from mmpg.runs import atomic_write_json
    from mmpg.toy.zoom_readout import held_out_trajectories, readout, run_config

    samples = min(READOUT[0], test_samples) if test_samples > 0 else READOUT[0]
    key = {"samples": samples, "attention": min(READOUT[1], samples)}
    path = checkpoint.parent.parent / "evals" / "readout" / f"{checkpoint.name}.json"
    if path.is_file():
        kept = json.loads(path.read_text(encoding="utf-8"))
        if {k: kept.get(k) for k in key} == key:
            return kept["readout"]
    cfg = run_config(checkpoint)
    items = held_out_trajectories(Path(cfg.data.videos), TASK, DATA_SEED)[:samples]
    result = dataclasses.asdict(readout(checkpoint, cfg, items, key["attention"]))
    atomic_write_json(path, {"v": 1, **key, "readout": result})
    return result


def rule_windows(videos: int) -> dict[str, tuple[float, float]]:
    """The rule policy's window of each of the task's videos (by video id), from its scenes redrawn, nothing decoded."""
    from mmpg.toy.zoom_task import rule_window, zoom_scenes

    return {scene.video_id: rule_window(scene, TASK) for scene in zoom_scenes(videos, DATA_SEED, TASK)}


def first_calls(predictions: Path, windows: dict[str, tuple[float, float]]) -> dict:
    """How a zoom evaluation's first turns called the tool (`predictions.jsonl`, parsed as the tool parses them):
    the share of test videos whose first call is the rule's window exactly, and how many distinct windows were
    called. The first turn is what the zoom arm's first SFT stage trains (docs/performance.md, tenth attempt)."""
    import json

    from mmpg.rollout.zoom import ZoomCall, parse_call

    count, exact, called = 0, 0, set()
    for line in predictions.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        count += 1
        turns = record.get("turns") or [{"model": record.get("text", "")}]
        call = parse_call(turns[0].get("model", ""))
        if isinstance(call, ZoomCall):
            called.add((call.start, call.end))
            rule = windows[Path(record["video"]).stem]
            exact += abs(call.start - rule[0]) < 1e-6 and abs(call.end - rule[1]) < 1e-6
    return {"rule_call_share": exact / count if count else 0.0, "distinct_calls": len(called)}


def frames_per_video(arm: str, metrics: dict, clips: Path | None = None) -> float:
    """Frames the model saw per test video: one look's, or the overview's plus the clips' (measured), or for the
    clip stage (`clips`: its test file) the rule window's clip alone, its frames as the tool samples them."""
    if clips is not None:
        import json

        import numpy as np

        from mmpg.toy.zoom_task import clip_times, zoom_scene

        windows = [json.loads(line) for line in clips.read_text(encoding="utf-8").splitlines() if line.strip()]
        scene = zoom_scene(np.random.default_rng(0), "any", TASK)  # the clip's frames depend on the task alone
        return sum(len(clip_times(scene, TASK, *w["clip"])) for w in windows) / max(1, len(windows))
    if arm == "zoom":
        return TASK.duration * TASK.overview_fps + float(metrics.get("zoom/clip_frames_mean", 0.0))
    return float(min(ONE_LOOK["max_frames"], TASK.duration * ONE_LOOK["fps"]))


COLUMNS = (("mIoU", "miou"), ("R1@0.3", "r1@0.3"), ("R1@0.5", "r1@0.5"), ("unparseable", "unparseable"))


def table(rows: list[dict]) -> list[str]:
    head = "| run | steps | frames per video | " + " | ".join(c for c, _ in COLUMNS) + \
        " | zoomed | first call the rule's (distinct calls) | start's units / tenths (nats) | start right | " \
        "flash pair's rank, last layer |"
    lines = [head, "|---|---:|---:|" + "---:|" * (len(COLUMNS) + 2) + "---|---:|---|"]
    for r in rows:
        m, calls, read = r["metrics"], r.get("first_calls"), r.get("readout")
        zoomed = f"{100 * m['zoom/used_share']:.0f} %" if "zoom/used_share" in m else ""
        rule = f"{100 * calls['rule_call_share']:.0f} % ({calls['distinct_calls']})" if calls else ""
        cells = " | ".join(f"{100 * float(m.get(k, float('nan'))):.1f}" for _, k in COLUMNS)
        answer = " | | "
        if read:
            nats = read["nats"]
            answer = (f" {nats.get('start_units', float('nan')):.2f} / {nats.get('start_tenths', float('nan')):.2f} | "
                      f"{100 * read['start_right']:.1f} % | " + ", ".join(f"{x:.1f}" for x in read["flash_rank"]) + " ")
        lines.append(f"| {r['label']} | {r['steps']} | {r['frames']:.1f} | {cells} | {zoomed} | {rule} |{answer}|")
    return lines


def run(workdir: str, plan: Plan) -> int:
    from transformers.utils import logging as hf_logging

    from mmpg.runs import atomic_write_json, atomic_write_text

    hf_logging.disable_progress_bar()
    if min(plan.sft_steps, plan.one_look_sft_steps, plan.grpo_steps) <= 0 or min(
            plan.unlisted_steps, plan.answer_steps, plan.clip_steps) < 0:
        raise UserError("every stage needs at least one step (--unlisted-steps, --clip-steps, --answer-steps: 0 or "
                        "more)")
    if plan.videos < 4:
        raise UserError(f"--videos {plan.videos}: at least 4 (a training and a test split)")
    paths = Paths.under(Path(workdir), plan.videos, plan.seed, plan.unlisted_steps, plan.answer_steps,
                        plan.clip_steps)
    print(f"zoom learning: zoom SFT {plan.unlisted_steps} without the tool's schema + {plan.clip_steps} on the clip "
          f"alone + {plan.answer_steps} of answers alone + {plan.sft_steps} + GRPO "
          f"{plan.grpo_steps} steps, one look SFT {plan.one_look_sft_steps} + GRPO {plan.grpo_steps}, seed "
          f"{plan.seed}" + (f", the {plan.arm} arm only" if plan.arm != "both" else "") + f", in {paths.workdir}",
          flush=True)
    t0 = time.perf_counter()
    built = ensure_artifacts(paths, plan.videos)
    print(f"  built now: {', '.join(built) if built else 'nothing (reused the checkpoint and videos there)'}",
          flush=True)
    rows, seconds, windows = [], {}, rule_windows(plan.videos)
    stages = {"zoom": [("sft-unlisted", plan.unlisted_steps), ("sft-clips", plan.clip_steps),
                       ("sft-answer", plan.answer_steps),
                       ("sft", plan.sft_steps), ("grpo", plan.grpo_steps)],
              "one_look": [("sft", plan.one_look_sft_steps), ("grpo", plan.grpo_steps)]}
    for arm, arm_stages in stages.items():
        if plan.arm not in ("both", arm):
            continue
        model = paths.model
        for kind, steps in arm_stages:
            if steps == 0:  # --unlisted-steps 0: the SFT lists the tool from its first step; --answer-steps 0
                continue
            model = run_stage(paths, arm, kind, model, steps, plan.seed)
            seconds[f"{arm}-{kind}"] = stage_seconds(paths.runs / f"{arm}-{kind}")
            result = evaluate(model, paths, arm, plan.test_samples, listed=kind != "sft-unlisted",
                              clips=kind == "sft-clips")
            if result.decoded:  # a reused evaluation took no time now, and its own is not recorded
                seconds[f"{arm}-{kind}-eval"] = result.seconds
            label = ("zoom" if arm == "zoom" else "one look") + {
                "sft-unlisted": ", SFT of the first turn alone (no tool schema)",
                "sft-clips": ", SFT of the answer on the clip alone (one look at the rule's window)",
                "sft-answer": ", SFT of the answer turn alone", "sft": ", SFT",
                "grpo": ", + GRPO"}[kind]
            zoomed = arm == "zoom" and kind != "sft-clips"  # a zoom protocol evaluation, a zoom run's config
            calls = first_calls(Path(result.folder) / "predictions.jsonl", windows) if zoomed else None
            read = answer_readout(model, plan.test_samples) if zoomed and kind.startswith("sft") else None
            rows.append({"arm": arm, "stage": kind, "label": label, "steps": steps, "checkpoint": str(model),
                         "eval": str(result.folder),
                         "frames": frames_per_video(arm, result.metrics, paths.data / TEST_CLIP_FILE
                                                    if kind == "sft-clips" else None),
                         "metrics": result.metrics, "first_calls": calls, "readout": read})
            rule = f"; the first call the rule's on {100 * calls['rule_call_share']:.0f} %" if calls else ""
            if read:
                rule += (f"; start's units / tenths {read['nats']['start_units']:.2f} / "
                         f"{read['nats']['start_tenths']:.2f} nats, flash pair's rank "
                         + ", ".join(f"{x:.1f}" for x in read["flash_rank"]))
            print(f"  {label}: mIoU {100 * result.metrics['miou']:.1f} on {int(result.metrics['count'])} test "
                  f"videos{rule}", flush=True)
    if plan.arm != "both":  # the comparison needs both arms: printed by a run of both, which reuses these
        text = "\n".join(["", f"zoom learning, {plan.arm} arm only (seed {plan.seed}; greedy answers on the "
                                f"{int(rows[0]['metrics']['count'])} held-out test videos):", "", *table(rows), "",
                           "run again without --arm for the comparison (it reuses these stages)"])
        print(text, flush=True)
        return 0
    final = {r["arm"]: r["metrics"]["miou"] for r in rows if r["stage"] == "grpo"}
    gap = 100 * (final["zoom"] - final["one_look"])
    zoomed = next(r["metrics"].get("zoom/used_share", 0.0) for r in rows if r["arm"] == "zoom" and r["stage"] == "grpo")
    lines = ["", f"zoom learning (seed {plan.seed}; greedy answers on the {int(rows[0]['metrics']['count'])} "
             "held-out test videos; % of queries, R1@m counts tIoU > m):", "", *table(rows), "",
             f"zoom + GRPO minus one look + GRPO: {gap:+.1f} mIoU points (the issue's bar: +10); the zooming model "
             f"called the tool on {100 * zoomed:.0f} % of the test videos",
             "time (training steps from each run's metrics.jsonl; evaluations decoded by this command): "
             + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
             + f"; this command {(time.perf_counter() - t0) / 60:.1f} min"]
    text = "\n".join(lines)
    paths.results.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.results / "summary.md", text + "\n")
    atomic_write_json(paths.results / "summary.json", {
        "v": 1, "plan": dataclasses.asdict(plan), "task": dataclasses.asdict(TASK), "model": MODEL_SIZE,
        "one_look": ONE_LOOK, "rows": rows, "gap_miou_points": gap, "zoom_used_share": zoomed, "seconds": seconds})
    print(text, flush=True)
    print(f"wrote {paths.results / 'summary.md'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoom_learning", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=WORKDIR, help="where the model, videos, runs and results go")
    parser.add_argument("--unlisted-steps", type=int, default=500,
                        help="zoom arm's first SFT steps, the tool's schema out of the system turn (0: none)")
    parser.add_argument("--clip-steps", type=int, default=0,
                        help="zoom arm's SFT steps of answers read off the clip alone (one look at each trajectory's "
                        "window, the copied answer) after those (0: none)")
    parser.add_argument("--answer-steps", type=int, default=0,
                        help="zoom arm's SFT steps of answer turns alone (calls out of the loss) after those (0: none)")
    parser.add_argument("--sft-steps", type=int, default=4500,
                        help="zoom arm's SFT steps of 8 trajectories after those, behind the prompt rollouts write")
    parser.add_argument("--one-look-sft-steps", type=int, default=None,
                        help="one-look arm's SFT steps of 8 samples (default: the zoom arm's SFT steps in all)")
    parser.add_argument("--grpo-steps", type=int, default=80, help="GRPO steps per arm (4 prompts x 8 samples)")
    parser.add_argument("--test-samples", type=int, default=0, help="test videos evaluated (0: all)")
    parser.add_argument("--videos", type=int, default=3000, help="videos of the task (a quarter are the test split)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (the videos' seed is fixed)")
    parser.add_argument("--arm", choices=ARMS, default="both", help="one arm only (two processes can train "
                        "the arms at once; a run of both afterwards reuses them and writes the comparison)")
    parser.add_argument("--readout", nargs="+", type=Path, metavar="CHECKPOINT", help="train nothing: print the answer "
                        "readout of these zoom checkpoints (RUN/checkpoints/step_N) on the first 200 test videos (at "
                        "most --test-samples) and exit")
    return parser


def print_readouts(checkpoints: list[Path], test_samples: int) -> int:
    """`--readout`: each checkpoint's answer readout, one line each (kept and reused as the experiment keeps them)."""
    from mmpg.toy.zoom_readout import Readout

    for checkpoint in checkpoints:
        if not (checkpoint / "config.json").is_file():
            raise UserError(f"{checkpoint}: not a checkpoint folder (no config.json)")
        print(f"{checkpoint}: {Readout(**answer_readout(checkpoint, test_samples)).line()}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    one_look = args.one_look_sft_steps if args.one_look_sft_steps is not None else \
        args.unlisted_steps + args.clip_steps + args.answer_steps + args.sft_steps
    plan = Plan(args.sft_steps, one_look, args.grpo_steps, args.test_samples, args.videos, args.seed,
                args.unlisted_steps, args.arm, args.answer_steps, args.clip_steps)
    try:
        if args.readout:
            return print_readouts(args.readout, args.test_samples)
        return run(args.workdir, plan)
    except UserError as err:
        print(f"zoom_learning: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
