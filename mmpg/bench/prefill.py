"""Peak memory of one long prefill, one forward vs chunked (`HFEngine(prefill_chunk=C)`, `mmpg.rollout.chunks`).

    python -m mmpg.bench.prefill                       # P = 16k tokens, chunks of 2k, tiny Qwen2.5-VL, CPU
    python -m mmpg.bench.prefill --P 32768 --chunk 4096 --json out.json

One prompt of P tokens (8 text tokens, one synthetic video of ~P tokens given as patches, text; `mmpg.bench.batch`)
on a random-weight model shaped so that activations dominate (hidden 256, MLP 2048, 2 layers, small vocabulary):
`generate_groups` with one response of one token, i.e. the vision tower, the prefill and the first token's sampling
(after a warm-up on a 256-token prompt, so one-time set-up is in neither peak).
Each variant runs in a fresh process, measured as `mmpg.bench.memory.measured` measures (CPU: the resident set's
high-water after clear_refs minus the RSS before; CUDA: max_memory_allocated), so one variant's freed pages cannot
hide the other's peak.

Columns: peak extra memory of the one-forward and the chunked prefill, their ratio, and the floor: the bytes chunking
cannot remove (the prompt's K/V in every layer, its input embeddings and video features [P, H]) over the one-forward
peak, i.e. the best ratio any chunk size could reach. dlogp: |token 0's logprob, chunked - one forward| (the same
token is asserted).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

SPEC = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 2048}
TARGET = 0.5  # issue 29: chunked peak <= 0.5 x the one-forward peak at P = 16k with 2k chunks


def run_one(P: int, chunk: int, family: str, device: str) -> dict:
    """One variant in this process: {peak, method, token, logprob, P (actual), floor}."""
    from mmpg.bench.batch import make_batch
    from mmpg.bench.memory import measured
    from mmpg.bench.model import build_model
    from mmpg.rollout import HFEngine, SamplingParams

    dev = torch.device(device)
    case = {"family": family, "spec": SPEC, "P": P, "S": 1, "G": 1}
    model, ids = build_model(case, dev)
    model.eval()
    inputs, info = make_batch(model, case, ids, dev)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=[])
    with torch.no_grad():  # warm-up on a short prompt (the same code paths): one-time set-up stays out of the peak
        warm, _ = make_batch(model, dict(case, P=256), ids, dev)
        HFEngine(model, ids["tokenizer"], decode="cascade", prefill_chunk=64 if chunk else 0).generate_groups(
            warm, 1, sampling)
        del warm
    engine = HFEngine(model, ids["tokenizer"], decode="cascade", prefill_chunk=chunk)
    with torch.no_grad(), measured(dev) as mem:
        out = engine.generate_groups(inputs, 1, sampling)
    text = model.config.get_text_config()
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = 2 * text.num_hidden_layers * info["P"] * text.num_key_value_heads * head * 4  # K and V, float32
    floor = kv + 2 * info["P"] * text.hidden_size * 4  # + input embeddings and video features [P, H]
    return {"peak": mem.peak, "method": mem.method, "token": int(out.completion_ids[0, 0]),
            "logprob": float(out.logprobs[0, 0]), "P": info["P"], "floor": floor}


def _child(P: int, chunk: int, family: str, device: str) -> dict:
    cmd = [sys.executable, "-m", "mmpg.bench.prefill", "--one", "--P", str(P), "--chunk", str(chunk),
           "--family", family, "--device", device]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def whole_vs_chunked(P: int, chunk: int, family: str, device: str) -> dict:
    """One row of the table: both variants, each in its own process."""
    whole, chunked = _child(P, 0, family, device), _child(P, chunk, family, device)
    if whole["token"] != chunked["token"]:
        raise AssertionError(f"P={P} chunk={chunk}: token 0 differs ({whole['token']} vs {chunked['token']})")
    ratio = chunked["peak"] / whole["peak"] if whole["peak"] and chunked["peak"] else None
    return {"P": whole["P"], "chunk": chunk, "family": family, "device": device, "method": whole["method"],
            "peak_MB": whole["peak"] and whole["peak"] / 2**20,
            "chunked_MB": chunked["peak"] and chunked["peak"] / 2**20,
            "ratio": ratio, "floor": whole["floor"] / whole["peak"] if whole["peak"] else None, "target": TARGET,
            "dlogp": abs(whole["logprob"] - chunked["logprob"])}


def table(rows: list[dict]) -> str:
    def f(x, spec):
        return "n/a" if x is None else format(x, spec)

    lines = ["| P | chunk | one forward MB | chunked MB | ratio | floor | target | dlogp |", "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['P']} | {r['chunk']} | {f(r['peak_MB'], '.0f')} | {f(r['chunked_MB'], '.0f')} | "
                     f"{f(r['ratio'], '.2f')} | {f(r['floor'], '.2f')} | {r['target']} | {r['dlogp']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--P", type=int, nargs="+", default=[16384], help="prompt tokens (default 16384)")
    p.add_argument("--chunk", type=int, default=2048, help="rollout.prefill_chunk of the chunked variant")
    # not qwen3_vl: its prompts put a timestamp before every frame, which the bench's synthetic batch does not build
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen2", "qwen3"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one variant, JSON on stdout
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.P[0], args.chunk, args.family, args.device)))
        return
    rows = [whole_vs_chunked(P, args.chunk, args.family, args.device) for P in args.P]
    print(f"prefill peak memory, {args.family} (hidden {SPEC['hidden_size']}, MLP {SPEC['intermediate_size']}, "
          f"{SPEC['num_layers']} layers), {args.device}, {rows[0]['method']}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
