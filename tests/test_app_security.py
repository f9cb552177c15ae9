"""The inspector's server: binds 127.0.0.1 by default and serves files only from inside the folder it was opened
on; path traversal and symlinks pointing out are refused. Plain HTTP requests, no browser."""

from __future__ import annotations

import http.client
import os

import pytest
from app_launch import launch_free

from mmpg.runs import RunReader
from synthetic_run import make_small_run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    run = make_small_run(root / "run")
    (root / "secret.txt").write_text("outside the run directory")
    key = RunReader(run).rollouts(1)[0].media_key
    os.symlink(root / "secret.txt", run / "media" / key / "leak.txt")
    page, url = launch_free(run, block=False, quiet=True)
    yield {"run": run.resolve(), "root": root.resolve(), "key": key, "page": page, "url": url}
    page.close()


def get(served, path: str) -> int:
    """Status of GET `path`, sent as is (http.client does not normalise '..' the way browsers do)."""
    conn = http.client.HTTPConnection("127.0.0.1", served["page"].server_port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_binds_localhost_by_default(served):
    assert served["page"].server_name == "127.0.0.1"
    assert served["url"].startswith("http://127.0.0.1:")


def test_files_inside_the_run_are_served(served):
    assert get(served, f"/gradio_api/file={served['run']}/media/{served['key']}/frame_00.jpg") == 200


@pytest.mark.parametrize("path", [
    "/gradio_api/file=/etc/passwd",
    "/gradio_api/file={root}/secret.txt",
    "/gradio_api/file={run}/../secret.txt",
    "/gradio_api/file={run}/media/../../secret.txt",
    "/gradio_api/file={run}/media/{key}/leak.txt",  # a symlink inside the run pointing out
    "/gradio_api/file={run}/media/{key}/%2e%2e/%2e%2e/%2e%2e/secret.txt",
])
def test_files_outside_are_refused(served, path):
    path = path.format(root=served["root"], run=served["run"], key=served["key"])
    assert get(served, path) == 403, path


def test_the_compare_page_serves_only_the_compared_runs(tmp_path):
    """Opened on a folder holding runs, the page may serve files inside each run, never the folder around them."""
    a, b = make_small_run(tmp_path / "a"), make_small_run(tmp_path / "b")
    (tmp_path / "secret.txt").write_text("beside the runs")
    page, url = launch_free(tmp_path, block=False, quiet=True)
    try:
        served = {"page": page}
        assert page.server_name == "127.0.0.1" and "2 runs" in page.title
        key = RunReader(a).rollouts(1)[0].media_key
        for run in (a, b):
            assert get(served, f"/gradio_api/file={run.resolve()}/media/{key}/frame_00.jpg") == 200
        assert get(served, f"/gradio_api/file={tmp_path.resolve()}/secret.txt") == 403
        assert get(served, f"/gradio_api/file={a.resolve()}/../secret.txt") == 403
    finally:
        page.close()


def test_a_failed_start_check_starts_the_server_again(tmp_path, monkeypatch):
    """Gradio gives up on its new server at the first connection error of its own check (a busy machine), saying
    localhost is not accessible: the inspector closes it and starts it again; every try failing is one clear error."""
    import gradio.networking

    from mmpg.errors import UserError

    run = make_small_run(tmp_path / "run")
    real, calls = gradio.networking.url_ok, []
    monkeypatch.setattr(gradio.networking, "url_ok", lambda url: (calls.append(url), len(calls) > 1 and real(url))[1])
    page, url = launch_free(run, block=False, quiet=True)
    try:
        assert len(calls) == 2  # refused once, started again, answered
        conn = http.client.HTTPConnection("127.0.0.1", page.server_port, timeout=30)
        conn.request("GET", "/")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        page.close()
    monkeypatch.setattr(gradio.networking, "url_ok", lambda url: False)
    with pytest.raises(UserError, match="did not answer its own check 3 times"):
        launch_free(run, block=False, quiet=True)
