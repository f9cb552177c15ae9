"""One thread owns the server's `vllm.LLM`: requests that arrive together are decoded together.

`LLM` is not thread-safe (enqueue and the engine's step share its scheduler and output processor), so the HTTP
threads only hand work to this loop. The loop does what `LLM.wait_for_completion` does — `llm_engine.step()` while
requests are unfinished, keeping the finished outputs — but admits every request waiting in its inbox before each
step, so a request that arrives while others decode joins vLLM's running batch at the next step (continuous
batching) instead of waiting for them to finish.

Work that must not overlap a request (a weight update, a collective call to the workers) is a barrier (`call`):
requests admitted before it finish first, on the weights they started with; requests behind it wait for it. So a
request is always served by one version of the weights, and `rollout.max_staleness` keeps its meaning.

vLLM's counters (prefix cache, processor cache) are global; a request's delta is its own only when no other request
was in flight during its life, so `Finished.counters` is None otherwise.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("mmpg.serve")


@dataclass
class Finished:
    """A request's outputs (vLLM's RequestOutputs in prompt order) and what the loop saw of it."""

    outputs: list
    version: int  # the weights that served it (a request runs on one version: updates wait for it)
    counters: dict | None  # vLLM's counter deltas over its life; None when other requests overlapped it
    timing_s: dict  # queue (waiting for admission), enqueue (vLLM's input processing), engine (admitted -> done)


@dataclass
class _Request:
    prompts: list
    params: list
    client: str = ""  # who sent it (the trainer's rank), counted in `stats["by_client"]`
    arrived: float = field(default_factory=time.perf_counter)
    future: Future = field(default_factory=Future)
    ids: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    counters: dict | None = None
    alone: bool = True
    version: int = 0
    admitted: float = 0.0
    timing_s: dict = field(default_factory=dict)


@dataclass
class _Barrier:
    fn: Callable
    future: Future = field(default_factory=Future)


class EngineLoop:
    """`make()` builds the LLM inside the loop's thread; `counters(llm)` reads vLLM's counters; `version()` names the
    weights a request is admitted on. `generate` and `call` block their caller until done."""

    def __init__(self, make: Callable[[], Any], counters: Callable[[Any], dict], version: Callable[[], int]):
        self._inbox: queue.Queue = queue.Queue()
        self._counters, self._version = counters, version
        # what /health shows: requests served, those that joined a batch already running, in flight now, barriers
        # waiting for them, requests served per client (a trainer rank: which ranks this server serves)
        self.stats = {"requests": 0, "joined": 0, "in_flight": 0, "waiting": 0, "by_client": {}}
        self._dead: BaseException | None = None
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make, ready), name="vllm-engine", daemon=True)
        self._thread.start()
        self.llm = ready.result()  # read-only use outside the loop (its config)

    def generate(self, prompts: list, params: list, client: str = "") -> Finished:
        """Decode `prompts` (one SamplingParams each) among whatever else is in flight; client: who asks."""
        request = _Request(prompts, params, client)
        self._put(request)
        return request.future.result()

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(llm) in the loop's thread once the requests admitted before it are done; later ones wait for it."""
        barrier = _Barrier(fn)
        self._put(barrier)
        return barrier.future.result()

    def snapshot(self) -> dict:
        """`stats` as /health shows them, copied (the loop's thread changes them)."""
        stats = dict(self.stats)
        stats["by_client"] = dict(stats["by_client"])
        return stats

    def shutdown(self, timeout: float = 60.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    def _put(self, item) -> None:
        if self._dead is not None:
            raise RuntimeError(f"the vLLM engine stopped ({type(self._dead).__name__}: {self._dead}); restart "
                               "mmpg vllm-serve")
        self._inbox.put(item)

    # ---- the loop's thread ----------------------------------------------------------------------------------
    def _run(self, make: Callable, ready: Future) -> None:
        try:
            llm = make()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            ready.set_exception(e)
            return
        ready.set_result(llm)
        engine = llm.llm_engine
        owner: dict[str, _Request] = {}  # vLLM request id -> the request it belongs to
        held: _Barrier | None = None
        stopping = False
        try:
            while True:
                while held is None and not stopping:  # admit everything waiting (block only when idle)
                    try:
                        item = self._inbox.get(block=not owner)
                    except queue.Empty:
                        break
                    if item is None:
                        stopping = True
                    elif isinstance(item, _Barrier):
                        held = item
                        self.stats["waiting"] = 1
                    else:
                        self._admit(llm, item, owner)
                if not owner:
                    if held is not None:
                        self._settle(held.future, held.fn, llm)
                        held = None
                        self.stats["waiting"] = 0
                        continue
                    if stopping:
                        return
                    continue
                for out in engine.step():
                    if out.finished:
                        self._finish(llm, out, owner)
        except BaseException as e:  # noqa: BLE001 - the engine died: everyone waiting hears it
            log.exception("the vLLM engine stopped")
            self._dead = e
            for request in {id(r): r for r in owner.values()}.values():
                request.future.set_exception(e)
            pending = [held] if held is not None else []
            while True:
                try:
                    pending.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in pending:
                if item is not None:
                    item.future.set_exception(e)
        finally:
            try:
                engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                log.debug("engine shutdown", exc_info=True)

    def _admit(self, llm, request: _Request, owner: dict) -> None:
        t0 = time.perf_counter()
        request.timing_s["queue"] = t0 - request.arrived
        if owner:  # others are in flight: counters will mix, for them and for this one (none read for it)
            for other in owner.values():
                other.alone = False
            request.alone = False
            self.stats["joined"] += 1
        else:
            request.counters = self._counters(llm)
        request.version = self._version()
        try:
            ids = llm.enqueue(request.prompts, sampling_params=request.params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - a prompt vLLM refuses fails its own request only
            request.future.set_exception(e)
            return
        t1 = time.perf_counter()
        request.timing_s["enqueue"], request.admitted = t1 - t0, t1
        request.ids = [str(i) for i in ids]
        self.stats["in_flight"] += 1
        for rid in request.ids:
            owner[rid] = request
            owner[rid.rsplit("-", 1)[0]] = request  # outputs carry the id without enqueue's random suffix

    def _finish(self, llm, out, owner: dict) -> None:
        request = owner.get(str(out.request_id))
        if request is None:
            return
        request.outputs[str(out.request_id)] = out
        if len(request.outputs) < len(request.ids):
            return
        for rid in request.ids:
            owner.pop(rid, None)
            owner.pop(rid.rsplit("-", 1)[0], None)
        self.stats["in_flight"] -= 1
        self.stats["requests"] += 1
        by_client = self.stats["by_client"]
        by_client[request.client] = by_client.get(request.client, 0) + 1
        if request.alone:
            after = self._counters(llm)
            counters = {k: after[k] - request.counters.get(k, 0) for k in after}
        else:
            counters = None
        request.timing_s["engine"] = time.perf_counter() - request.admitted
        by_id = {rid: request.outputs.get(rid) or request.outputs.get(rid.rsplit("-", 1)[0]) for rid in request.ids}
        request.future.set_result(Finished([by_id[rid] for rid in request.ids], request.version, counters,
                                          request.timing_s))

    @staticmethod
    def _settle(future: Future, fn: Callable, llm) -> None:
        try:
            future.set_result(fn(llm))
        except Exception as e:  # noqa: BLE001 - the caller's error, raised in its thread
            future.set_exception(e)
