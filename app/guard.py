"""Handlers never raise into Gradio: a problem becomes a message in the page's status line, so a damaged file, a
missing step or a newer layout shows as one readable sentence, never as an error page or a traceback."""

from __future__ import annotations

import functools
import logging

from mmpg_app.render import message_html
from mmpg.errors import UserError

log = logging.getLogger("mmpg.app")


def guarded(status, clear: bool = True):
    """Decorator for a handler returning {component: value}: on an error only the status line changes, to the
    message; on success it is cleared (unless the handler set it, or `clear` is False: a timer tick must not wipe
    a message the user has not read)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                out = fn(*args, **kwargs)
            except UserError as e:
                return {status: message_html(str(e), "error")}
            except Exception as e:  # a bug or an unexpected file: log the traceback, show one line
                log.exception("inspector: %s failed", fn.__name__)
                return {status: message_html(f"could not show this ({type(e).__name__}: {e}); details in the log",
                                             "error")}
            if clear:
                out.setdefault(status, "")
            return out

        return wrapper

    return deco
