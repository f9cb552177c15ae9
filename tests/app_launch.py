"""The inspector launched on a free port for the tests that open it in a browser or over HTTP."""

from __future__ import annotations

from mmpg.serve.launch import free_port

TRIES = 5


def launch_free(path, **kwargs):
    """`mmpg_app.server.launch(path, port=<free>, **kwargs)` -> (page, url). Another process may take the port
    between `free_port` and Gradio's bind (a client's ephemeral port on a busy machine); Gradio then says it "cannot
    find empty port", and another free port is tried, up to TRIES times."""
    from mmpg_app.server import launch

    attempt = 1
    while True:
        try:
            return launch(path, port=free_port(), **kwargs)
        except OSError as e:
            if "Cannot find empty port" not in str(e) or attempt == TRIES:
                raise
            attempt += 1
