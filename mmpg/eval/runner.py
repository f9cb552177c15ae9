"""Evaluate one checkpoint on a grounding benchmark: greedy answers, per-sample records, metrics, report, plots.

    result = evaluate_checkpoint("runs/x/checkpoints/step_00000040", "charades_sta_test.txt", "Charades_v1_480",
                                 "evals/x-40/charades", load_settings("time_r1", ["prompt_file=time_r1.py"]))

    samples (annotation order) --fixed batches (share_videos: whole videos), rank r takes batches r::W-->
       DataLoader workers decode videos (once per batch) and build prompts
       --HFEngine.generate_groups(group size 1, temperature 0)--> answers --parse, tIoU--> PredictionRecords
       --gather to rank 0 after every batch--> predictions.jsonl (appended as produced)
    at the end, rank 0: metrics.json, plots/*.png, report.md (all written atomically)

Resuming: the indices already in predictions.jsonl are skipped, so a rerun after a kill decodes only the rest and
ends with the same metrics. A rerun with other settings into the same folder is refused (`check_settings`). Under
torchrun (WORLD_SIZE > 1) every rank loads the model and answers whole fixed batches (batches.py says why), so the
predictions equal one process's; ranks make the same number of gathers (an idle rank gathers an empty list).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

from mmpg.errors import UserError
from mmpg.eval.batches import DecodeCounts, decode_pending
from mmpg.eval.metrics import denominator_metrics
from mmpg.eval.settings import EvalSettings, numbers_settings
from mmpg.runs.evals import EvalReader, EvalWriter, check_settings

log = logging.getLogger("mmpg.eval")

VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@dataclasses.dataclass
class Placement:
    """Where this process evaluates: its rank, the world size and its device."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"  # "cpu" or "cuda:<local rank>"


@contextlib.contextmanager
def eval_session(device: str = "auto"):
    """The process group when launched with WORLD_SIZE > 1 (gloo on CPU, NCCL on GPUs), else a world of one."""
    import torch

    from mmpg import dist

    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but torch sees no CUDA device; use device=cpu or device=auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    started = world > 1 and not dist.active()
    if started:
        dist.init(kind)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        yield Placement(dist.rank(), dist.world_size(), f"cuda:{local}" if kind == "cuda" else "cpu")
    finally:
        if started:
            dist.shutdown()


@dataclasses.dataclass
class EvalResult:
    folder: Path
    metrics: dict | None  # None on ranks other than 0
    decoded: int  # samples answered by this call, over all ranks
    reused: int  # samples already in predictions.jsonl
    seconds: float  # the whole call: loading, decoding, writing the report
    decode_seconds: float = 0.0  # decoding alone (videos, prompts, answers, records)
    counts: DecodeCounts = dataclasses.field(default_factory=DecodeCounts)  # what this call's decoding did


@dataclasses.dataclass
class Benchmark:
    name: str
    annotations: str
    videos: str | None
    samples: list  # [GroundingSample] to evaluate: the file's first settings.max_samples (all when 0)
    size: int  # samples the loader kept (the file's queries minus left_out)
    left_out: list  # [(where, why)] of the annotation records the loader could not use
    clamped: int = 0  # kept samples whose ground truth ends past the stated duration (raw_span set)


def load_benchmark(annotations, videos, settings: EvalSettings, name: str | None = None) -> Benchmark:
    """The samples of an annotation file; UserError when it holds none."""
    from mmpg.data.formats import load_annotations

    # a paper's scoring evaluates every record with a readable span, as its loader keeps them (formats.py)
    result = load_annotations(annotations, videos or None, fmt=settings.format, strict=False,
                              keep_all=settings.scoring != "mmpg")
    if not result.samples:
        first = f"; first: {result.skipped[0].where}: {result.skipped[0].reason}" if result.skipped else ""
        raise UserError(f"{annotations}: the benchmark is empty, no usable sample to evaluate "
                        f"({len(result.skipped)} records left out{first})")
    n = settings.max_samples
    return Benchmark(name or Path(annotations).stem, str(annotations), str(videos) if videos else None,
                     result.samples[:n] if n > 0 else result.samples, len(result.samples),
                     [tuple(s) for s in result.skipped], sum(s.raw_span is not None for s in result.samples))


def left_out_reasons(left_out: list) -> dict[str, int]:
    """{reason with its numbers replaced by N: count} of the records the loader left out, most common first."""
    import re
    from collections import Counter

    from mmpg.eval.markdown import reason_kind

    kinds = Counter(reason_kind(re.sub(r" in sample \S+$", "", why)) for _, why in left_out)
    return dict(kinds.most_common())


def load_model(checkpoint, settings: EvalSettings, device: str):
    """(model, processor, family, dtype name); one UserError line for a missing, broken or non-video checkpoint.
    A LoRA adapter checkpoint (`mmpg.models.lora_export`) is loaded on its base and merged: the model `mmpg export`
    writes, so both evaluate alike."""
    from transformers import AutoConfig

    from mmpg.models.loading import load_policy, load_processor, resolve_checkpoint
    from mmpg.models.lora_export import adapter_base, is_adapter_checkpoint, load_adapter_model, load_any_processor

    adapter = is_adapter_checkpoint(checkpoint)  # LoRA: evaluated as its base with the adapter merged in
    path = adapter_base(checkpoint) if adapter else resolve_checkpoint(checkpoint)
    dtype = settings.dtype if settings.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        family = AutoConfig.from_pretrained(path).model_type
    except Exception as e:  # noqa: BLE001 - a damaged config.json: one line naming the folder
        raise UserError(f"{checkpoint}: cannot read the checkpoint's config ({_first_line(e)})") from None
    if family not in VIDEO_FAMILIES:
        raise UserError(f"{checkpoint} holds a {family!r} model; grounding evaluation needs a video model "
                        f"({' or '.join(VIDEO_FAMILIES)})")
    try:
        if adapter:
            processor = load_any_processor(checkpoint)
            model = load_adapter_model(checkpoint, dtype=dtype, device=device)
        else:
            processor = load_processor(path)
            model = load_policy(path, dtype=dtype, device=device)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - missing or damaged weights, tokenizer, processor files
        raise UserError(f"{checkpoint}: cannot load the checkpoint ({_first_line(e)})") from None
    from mmpg.grouping import set_grouping_options

    set_grouping_options(model, backend=settings.grouping_backend)  # the shared prefill's backend
    _record_grouped_backend(model, settings.grouping_backend, device)
    model.eval()
    return model, processor, family, dtype


def _record_grouped_backend(model, name: str, device: str) -> None:
    """`mmpg.choices` "grouped_backend": the shared prefill's backend as resolved for this device and dtype."""
    import torch

    from mmpg import choices
    from mmpg.grouping.backends import compute_dtype, resolve_backend

    dev = torch.device(device)
    chosen = resolve_backend(name, dev, compute_dtype(model, dev))
    choices.record("grouped_backend", chosen, "" if chosen == name else f"grouping_backend={name} on {dev.type}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def eval_info(checkpoint, bench: Benchmark, protocol: str, step, settings: EvalSettings, family: str, dtype: str,
              spec, template, session: Placement) -> dict:
    """What eval.json records: the inputs and every setting that changes the numbers (compared on a rerun)."""
    import torch
    import transformers

    from mmpg import __version__ as mmpg_version

    video = {k: v for k, v in spec.element("").items() if k not in ("type", "video")}
    numbers = dict(numbers_settings(settings), dtype=dtype, family=family, video=video,
                   template_text={"user": template.user, "system": template.system, "think": template.think},
                   parser={"mmpg": "mmpg.rewards.parse_answer", "timelens": "mmpg.eval.metrics.timelens_span"}.get(
                       settings.scoring, "mmpg.eval.metrics.last_span"))
    return {
        "checkpoint": str(Path(checkpoint).expanduser().resolve()) if Path(checkpoint).expanduser().exists()
        else str(checkpoint),
        "annotations": str(Path(bench.annotations).resolve()),
        "videos": str(Path(bench.videos).resolve()) if bench.videos else None,
        "protocol": protocol, "benchmark": bench.name, "step": step, "settings": numbers,
        "benchmark_size": bench.size, "evaluated": len(bench.samples),
        "annotations_left_out_count": len(bench.left_out), "annotations_left_out": bench.left_out[:20],
        "annotations_left_out_reasons": left_out_reasons(bench.left_out),
        "annotations_records": bench.size + len(bench.left_out), "ground_truth_clamped": bench.clamped,
        "runtime": {"device": session.device, "world_size": session.world, "batch_size": settings.batch_size,
                    "share_videos": settings.share_videos, "num_workers": settings.num_workers,
                    "mmpg": mmpg_version, "torch": torch.__version__,
                    "transformers": transformers.__version__},
    }


def _open_folder(writer: EvalWriter, info: dict, n: int, session: Placement) -> set[int]:
    """Rank 0 checks and opens the folder; every rank gets the indices already done (or the same error)."""
    from mmpg import dist

    done, error = set(), None
    if session.rank == 0:
        try:
            check_settings(writer.folder, info, defaults={"settings": numbers_settings(EvalSettings())})
            writer.start(info)
            done = {i for i in writer.done() if i < n}
        except UserError as e:
            error = str(e)
    done, error = dist.gather_objects((done, error))[0]
    if error:
        raise UserError(error)
    return done


def evaluate_checkpoint(checkpoint, annotations, videos, out, settings: EvalSettings, *, protocol: str = "default",
                        benchmark: str | None = None, step: int | None = None,
                        session: Placement | None = None) -> EvalResult:
    """Evaluate `checkpoint` into the folder `out` (created, or continued when it holds a killed evaluation)."""
    from mmpg.data.video import VideoSpec
    from mmpg.eval.protocols import eval_template

    t0 = time.time()
    with contextlib.ExitStack() as stack:
        session = session or stack.enter_context(eval_session(settings.device))
        bench = load_benchmark(annotations, videos, settings, benchmark)
        model, processor, family, dtype = load_model(checkpoint, settings, session.device)
        spec = VideoSpec.for_family(family, **settings.video_values_for(family))  # *_tokens scaled per family
        template = eval_template(settings.template, settings.prompt_file, settings.query_clean,
                                 list_tools=settings.zoom_list_tools)
        result = evaluate_loaded(model, processor, checkpoint, bench, out, settings, session, spec, template,
                                 family=family, dtype=dtype, protocol=protocol, step=step)
        del model
    result.seconds = time.time() - t0
    return result


def evaluate_loaded(model, processor, checkpoint, bench: Benchmark, out, settings: EvalSettings, session: Placement,
                    spec, template, *, family: str, dtype: str, protocol: str = "default", step: int | None = None,
                    lockstep: bool = False) -> EvalResult:
    """Evaluate a model already in memory into the folder `out` (what `evaluate_checkpoint` and training's held-out
    evaluation share). `checkpoint`: what eval.json names as the evaluated weights. `lockstep`: every rank runs the
    same forwards (a ZeRO-3 model gathers its weights in each one; `decode_pending` says how)."""
    from mmpg import dist

    t0 = time.time()
    info = eval_info(checkpoint, bench, protocol, step, settings, family, dtype, spec, template, session)
    writer = EvalWriter(out, rank=session.rank)
    n = len(bench.samples)
    done = _open_folder(writer, info, n, session)
    pending = [i for i in range(n) if i not in done]
    if session.rank == 0:
        log.info("%s: %d samples, %d already in %s, %d to decode on %d rank(s)", bench.name, n, len(done),
                 writer.folder, len(pending), session.world)
    t1 = time.time()
    counts = decode_pending(model, processor, bench.samples, pending, spec, template, settings, writer, session,
                            lockstep=lockstep)
    t2 = time.time()
    metrics = finish(writer.folder, n, settings, counts) if session.rank == 0 else None
    dist.barrier()
    return EvalResult(Path(out), metrics, counts.samples, len(done), time.time() - t0, t2 - t1, counts)


def finish(folder, n: int, settings: EvalSettings, counts: DecodeCounts | None = None) -> dict:
    """Rank 0, once every sample has a record: metrics.json, the plots, report.md (each written atomically).
    metrics.json's perf/* keys are `counts`: what this call decoded (a rerun that only finishes counts its part)."""
    from mmpg.eval import plots
    from mmpg.eval.protocols import PROTOCOLS
    from mmpg.eval.markdown import eval_report

    reader = EvalReader(folder)
    records = [r for r in reader.predictions() if r.index < n]
    missing = sorted(set(range(n)) - {r.index for r in records})
    if missing:
        raise UserError(f"{folder}: {len(missing)} samples have no prediction (first index {missing[0]}); run the "
                        "evaluation again to complete it")
    info = reader.info()
    metrics, counted = denominator_metrics(records, settings.bad_videos, settings.duplicates)
    metrics.update(threshold_rule=settings.threshold_rule, bad_videos=settings.bad_videos)
    metrics.update((counts or DecodeCounts()).metrics())
    from mmpg.eval.metrics import zoom_metrics

    metrics.update(zoom_metrics(counted))  # template=zoom: zooms, errors, clip frames, mIoU by zoom count
    writer = EvalWriter(folder)
    writer.write_metrics(metrics)
    scored = [r for r in counted if settings.bad_videos == "fail" or r.error is None]
    ious = [r.iou for r in scored]
    title = f"{info.get('benchmark')} ({info.get('protocol')})"
    plots.recall_plot(writer.plot_path("recall_vs_threshold.png"), ious, settings.threshold_rule, title)
    plots.iou_histogram(writer.plot_path("iou_histogram.png"), ious, sum(r.pred_span is None for r in scored))
    plots.start_end_plot(writer.plot_path("start_end.png"),
                         [(tuple(r.pred_span), tuple(r.gt_span)) for r in counted if r.pred_span is not None])
    protocol = PROTOCOLS.get(info.get("protocol"))
    from mmpg import choices

    info = dict(info, fast_paths=choices.current())  # what this process's fast paths chose (decode kernel, ...)
    writer.write_text("report.md", eval_report(info, metrics, records, protocol.summary if protocol else ""))
    return reader.metrics()  # as written: NaN as null, with the layout version
