"""`mmpg bench --levels vllm`: how one `mmpg vllm-serve` serves two trainer ranks' rollout requests.

    mmpg bench --levels vllm [--vllm-sizes 2x4x48,4x8x24] [--rounds 3] [--server-core 1] [--trainer-core 0]
                             [--vllm-servers 2]

One tiny Qwen2.5-VL that vLLM serves (`mmpg.bench.overlap.SPEC`, float32), the server on --server-core, the two
ranks (two `VLLMEngine` clients in threads of this process) on --trainer-core. Per size BxGxS (each rank's request:
B text prompts, G samples of S tokens each, seeded per prompt, no stop) three ways of sending the two ranks' work:
one request carrying both ranks' prompts (the batching ceiling: the engine's own batch), both ranks at once (what a
2-rank step does), and one rank after the other (what a server that serves one request at a time gives). Medians
over --rounds, the modes interleaved; every way must sample the same tokens (checked, printed). On a CPU the tiny
model's decode is compute-bound, so the ceiling's gain over one after another is modest; on a GPU's memory-bound
decode it is large. Then (--vllm-servers 2, on a machine of 2+ cores) both ranks at once on two servers, each rank
its own and each server its own core, against the one server: the ceiling is 2x (each server decodes its rank's
work in parallel, as a pool of one server per rollout GPU does).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

MODES = ("one request", "at once", "one after another")


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """"2x4x48,4x8x24" -> [(2, 4, 48), (4, 8, 24)]; a UserError (one line) naming the bad entry."""
    from mmpg.errors import UserError

    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UserError(f"--vllm-sizes: {item!r} is not BxGxS (prompts per rank x samples x tokens), e.g. 2x4x48")
        out.append(tuple(int(p) for p in parts))
    return out


def format_table(rows: list[dict]) -> str:
    head = ("| per rank (B x G x S) | one request s | at once s | one after another s | at once / one request | "
            "one after another / one request | ceiling | same tokens |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        one = r["median_s"]["one request"]
        lines.append(f"| {r['B']} x {r['G']} x {r['S']} | {one:.3f} | {r['median_s']['at once']:.3f} | "
                     f"{r['median_s']['one after another']:.3f} | {r['median_s']['at once'] / one:.2f}x | "
                     f"{r['median_s']['one after another'] / one:.2f}x | 1.00x | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(lines)


def _pool_row(r: dict) -> str:
    return (f"| {r['B']} x {r['G']} x {r['S']} | {r['one_s']:.3f} | {r['two_s']:.3f} | {r['one_s'] / r['two_s']:.2f}x "
            f"| 2.00x | {'yes' if r['same'] else 'NO'} |")


def format_pool_table(rows: list[dict]) -> str:
    """Two ranks at once: one server on one core against two servers on a core each (the ceiling: 2x, each rank's
    work decoded in parallel, as one server per rollout GPU)."""
    head = "| per rank (B x G x S) | one server s | two servers s | speed-up | ceiling | same tokens |"
    return "\n".join([head, "|" + "---|" * 6] + [_pool_row(r) for r in rows])


def _in_threads(*jobs):
    out, gate = [None] * len(jobs), threading.Barrier(len(jobs))

    def run(i, job):
        gate.wait()
        out[i] = job()

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(urls: list[str], model, processor, B: int, G: int, S: int, rounds: int,
            modes: tuple[str, ...] = MODES) -> dict:
    """One size's row: each mode's seconds per round, medians, and whether all sampled the same tokens. Rank r
    sends to urls[r mod len(urls)] (two servers: each rank its own)."""
    from mmpg.rollout import SamplingParams
    from mmpg.rollout.vllm import VLLMEngine

    texts = [processor.apply_chat_template([{"role": "user", "content": f"Question {i}: when does event {i} "
                                             "happen in the video?"}], tokenize=False, add_generation_prompt=True)
             for i in range(2 * B)]
    inputs = processor(text=texts, padding=True, padding_side="left", return_tensors="pt")
    seeds = [1000 + i for i in range(2 * B)]
    sampling = SamplingParams(max_new_tokens=S, temperature=1.0, stop_token_ids=())
    ranks = [VLLMEngine(model, processor, url=urls[r % len(urls)], timeout_s=600) for r in range(2)]

    def rank(r):
        part = {k: v[r * B:(r + 1) * B] for k, v in inputs.items()}
        return ranks[r].generate_groups(part, G, sampling, prompt_seeds=seeds[r * B:(r + 1) * B]).completion_ids

    def flat(pair):
        return [row for ids in pair for row in ids.tolist()]

    reference = ranks[0].generate_groups(inputs, G, sampling, prompt_seeds=seeds).completion_ids.tolist()  # warm
    if len(urls) > 1:
        rank(1)  # warm the second server too
    ways = {"one request": lambda: [ranks[0].generate_groups(inputs, G, sampling, prompt_seeds=seeds)
                                    .completion_ids],
            "at once": lambda: _in_threads(lambda: rank(0), lambda: rank(1)),
            "one after another": lambda: [rank(0), rank(1)]}
    seconds, same = {m: [] for m in modes}, True
    for _ in range(rounds):
        for m in modes:
            t0 = time.perf_counter()
            got = ways[m]()
            seconds[m].append(time.perf_counter() - t0)
            same = same and flat(got) == reference
    return {"B": B, "G": G, "S": S, "seconds": seconds, "same": same,
            "median_s": {m: statistics.median(v) for m, v in seconds.items()}}


def run(args) -> int:
    """Start the server, measure every size, print the table, write the JSON; 0 when every way sampled alike."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpg.bench import tables
    from mmpg.bench.overlap import SPEC, PinnedServer
    from mmpg.toy.models import TinySpec, make_tiny

    sizes = parse_sizes(args.vllm_sizes)
    rounds = args.rounds or 3
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        make_tiny("qwen2_5_vl", tmp / "model", seed=0, spec=TinySpec(**SPEC))
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

        def start(core: int, name: str) -> PinnedServer:
            return PinnedServer(core, tmp / "model", tmp / f"{name}.log", max_model_len=1024, env=env)

        torch.set_num_threads(1)
        model = AutoModelForImageTextToText.from_pretrained(tmp / "model", dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(tmp / "model")
        server = start(args.server_core, "server")
        try:
            print(f"mmpg bench --levels vllm: server on core {args.server_core} up in {server.wait():.0f} s, two "
                  f"ranks on core {args.trainer_core}, {rounds} round(s)", flush=True)
            os.sched_setaffinity(0, {args.trainer_core})  # this thread, and the rank threads it starts
            rows = []
            for B, G, S in sizes:
                rows.append(measure([server.url], model, processor, B, G, S, rounds))
                print(f"  {B} x {G} x {S}: " + ", ".join(f"{m} {rows[-1]['median_s'][m]:.3f} s" for m in MODES),
                      flush=True)
        finally:
            server.stop()
        pool = []
        if args.vllm_servers > 1 and len(cores) >= 2:  # each rank its own server, each server its own core
            os.sched_setaffinity(0, set(cores))
            servers = [start(cores[i % len(cores)], f"server{i}") for i in range(2)]
            try:
                for s in servers:
                    s.wait()
                print(f"  two servers, on cores {cores[0]} and {cores[1 % len(cores)]}", flush=True)
                for row in rows:
                    two = measure([s.url for s in servers], model, processor, row["B"], row["G"], row["S"],
                                  rounds, modes=("at once",))
                    pool.append({"B": row["B"], "G": row["G"], "S": row["S"], "one_s": row["median_s"]["at once"],
                                 "two_s": two["median_s"]["at once"], "same": two["same"]})
            finally:
                for s in servers:
                    s.stop()
    print("\n" + format_table(rows))
    if pool:
        print("\n" + format_pool_table(pool))
    out = Path(args.out or tables.default_out_path())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "two_servers": pool, "rounds": rounds,
                               "environment": tables.provenance()}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["same"] for r in rows + pool) else 1
