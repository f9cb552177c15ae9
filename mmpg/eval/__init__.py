"""mmpg.eval: grounding benchmarks for checkpoints (never imports the trainer; reads runs through mmpg.runs).

    metrics.py     pure: R1@{0.3,0.5,0.7} under both conventions (tIoU > m: Time-R1, >= m: VideoChat-R1), mIoU,
                   answers scored through mmpg.rewards.parse_answer (unparseable = IoU 0)
    settings.py    EvalSettings: defaults <- protocol preset <- key=value (OmegaConf, one-line errors)
    protocols.py   named presets (default, time_r1, videochat_r1), each naming where its numbers come from
    runner.py      evaluate_checkpoint: load, shard over ranks, resume from predictions.jsonl, finish the folder
    batches.py     the decoding loop: greedy answers from the shared-prefix engine (group size 1, temperature 0)
    run_dir.py     evaluate_run: every complete checkpoint of a training run, then over_steps.md|png
    report.py      report.md and over_steps.md (pure text)
    plots.py       PNGs through matplotlib's Agg backend, written atomically
    decode.py      `predict`: held-out evaluation during training (mmpg/rl/evaluate.py)
    speed.py       python -m mmpg.eval.speed: batched engine vs model.generate one sample at a time
    cli.py         the `mmpg eval` subcommand

The evaluation folder's layout is documented once, in mmpg/runs/evals.py.
"""
