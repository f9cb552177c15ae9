from mmpg.runs import layout as _layout
from mmpg.runs.checkpoints import (
    checkpoint_dir,
    finalize_checkpoint,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    mark_complete,
    prune_checkpoints,
    temp_checkpoint_dir,
)
from mmpg.runs.evals import EvalReader, EvalWriter, PredictionRecord, list_run_evals, run_eval_dir
from mmpg.runs.files import atomic_write_json, atomic_write_text, read_jsonl
from mmpg.runs.layout import (
    CHECKPOINTS_DIR,
    COMPLETE,
    CONFIG_YAML,
    EVAL_JSONL,
    LAYOUT_VERSION,
    MEDIA_DIR,
    METRICS_JSONL,
    ROLLOUTS_DIR,
    RUN_JSON,
    TB_DIR,
    TRAIN_LOG,
    media_key,
)
from mmpg.runs.reader import RunReader, metric_series
from mmpg.runs.records import GroupRecord, ResponseRecord
from mmpg.runs.writer import RunWriter

__doc__ = _layout.__doc__  # the run directory's contract (its format: docs/inspector.md)

__all__ = [
    "EvalReader",
    "EvalWriter",
    "PredictionRecord",
    "list_run_evals",
    "run_eval_dir",
    "CHECKPOINTS_DIR",
    "COMPLETE",
    "CONFIG_YAML",
    "EVAL_JSONL",
    "LAYOUT_VERSION",
    "MEDIA_DIR",
    "METRICS_JSONL",
    "ROLLOUTS_DIR",
    "RUN_JSON",
    "TB_DIR",
    "TRAIN_LOG",
    "GroupRecord",
    "ResponseRecord",
    "RunReader",
    "RunWriter",
    "atomic_write_json",
    "atomic_write_text",
    "checkpoint_dir",
    "finalize_checkpoint",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "mark_complete",
    "metric_series",
    "prune_checkpoints",
    "read_jsonl",
    "temp_checkpoint_dir",
    "media_key",
]
