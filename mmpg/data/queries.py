"""How a query's text is cleaned before it goes into the prompt: one rule per convention (`clean_query`).

Papers differ here, and the prompt a checkpoint sees moves with them (Charades-STA writes every query with a final
period, ActivityNet Captions starts most of its val_2 sentences with a space, TVGBench ends 135 of its 800 questions
with one). Each rule is what one codebase does, written out from its source:

    mmpg       mmpg's training prompts: whitespace at both ends, then trailing periods ("a b." -> "a b")
    strip      Time-R1's Charades-STA / ActivityNet loaders (`load_charades`, `load_activitynet` in
               src/vllm_inference/data/data_loader.py: `sentence.strip()`): whitespace at both ends, periods kept
    as_written the file's text unchanged: Time-R1's `load_tvgbench` (its `question`) and VideoChat-R1's
               `GROUND_TEMPLATE.replace('[EVENT]', sentence)` (src_eval/evaluate_tg_c8.py, later evaluate_grounding.py)
    timelens   TimeLens's `parse_query` (timelens/dataset/timelens_data.py): runs of whitespace become one space,
               then whitespace, periods, whitespace stripped at both ends (".a b.." -> "a b")

The annotation loaders strip whitespace at both ends of `GroundingSample.query` (and squash it for TimeLens-Bench);
the text as the file has it is kept in `GroundingSample.raw_query` when it differs, which is what `as_written` uses.
"""

from __future__ import annotations

import re

from mmpg.errors import UserError

QUERY_CLEANINGS = ("mmpg", "strip", "as_written", "timelens")


def clean_query(text: str, rule: str = "mmpg") -> str:
    """`text` cleaned by `rule` (module docstring). "a person sits down." -> mmpg "a person sits down", strip and
    as_written "a person sits down.", timelens "a person sits down"."""
    if rule == "mmpg":
        return text.strip().rstrip(".")
    if rule == "strip":
        return text.strip()
    if rule == "as_written":
        return text
    if rule == "timelens":
        return re.sub(r"\s+", " ", text).strip().strip(".").strip()
    raise UserError(f"unknown query cleaning {rule!r}; choose one of {', '.join(QUERY_CLEANINGS)}")


def sample_query(sample, rule: str = "mmpg") -> str:
    """The query of `sample` (a GroundingSample) as it goes into a prompt under `rule`. `as_written` takes the
    file's own text (`raw_query`, when the loader changed it); the other rules clean the loaded `query`, which gives
    the same text as cleaning the file's (each strips whitespace at both ends first), and keeps mmpg's prompts on
    TimeLens-Bench files with their whitespace runs squashed."""
    raw = getattr(sample, "raw_query", None) if rule == "as_written" else None
    return clean_query(raw if raw is not None else sample.query, rule)
