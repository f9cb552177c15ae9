"""The Gradio pieces the run and evaluation views build the same way: pickers whose choices the server changes,
numbers typed or clicked in the browser, and the sortable tables with their failed rows tinted red.

Every value that comes back from the browser is checked here or by the handler that gets it: a picker takes any
value, so a handler may receive stale or hand-typed text and answers it with a `UserError`, never a traceback.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from mmpg.errors import UserError

SORT_HINT = "{what}; to sort or filter, open a column's ⋮ menu (on its header)"
FAILED_ROW = "background-color: #fde2e1; color: #7a1c16"


def picker(label: str, elem_id: str, **kwargs) -> gr.Dropdown:
    """A dropdown whose choices the server changes. It takes any value (allow_custom_value): a timer tick can carry
    the old value while new choices are on their way, and Gradio's own check would then pop an error. The
    handlers check every value they get."""
    return gr.Dropdown(label=label, choices=[], elem_id=elem_id, allow_custom_value=True, **kwargs)


def as_int(value, what: str = "a step number") -> int | None:
    """A number from the browser (int, or text typed in a box); None for nothing; UserError for anything else."""
    if value is None or value == "":
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        raise UserError(f"{value!r} is not {what}") from None


def empty_table() -> pd.DataFrame:
    return pd.DataFrame({"#": pd.Series(dtype="int64")})


def highlighted(frame: pd.DataFrame, rows: list[int]):
    """The table with the failed responses' rows tinted red (a pandas Styler, which Gradio draws with its styles)."""
    styles = [[FAILED_ROW if i in rows else ""] * frame.shape[1] for i in range(len(frame))]
    return (frame.style.apply(lambda _: pd.DataFrame(styles, index=frame.index, columns=frame.columns), axis=None)
            .format(_cell))


def _cell(v) -> str:
    """A cell as the table shows it: 10.0 as '10', 0.25 as '0.25', a missing value empty."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    return f"{v:g}" if isinstance(v, float) else str(v)
