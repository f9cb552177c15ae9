"""mmpg.eval: grounding benchmarks for checkpoints (never imports mmpg.train, mmpg.rl or mmpg.sft; reads runs through
mmpg.runs; its collectives come from mmpg.dist).

    metrics.py     pure: R1@{0.3,0.5,0.7} under both conventions (tIoU > m: Time-R1, >= m: VideoChat-R1), mIoU,
                   answers scored as the protocol says; unparseable = IoU 0
    settings.py    EvalSettings: defaults <- protocol preset <- key=value (OmegaConf, one-line errors)
    protocols.py   named presets (default, time_r1, videochat_r1, tvgbench, timelens), each naming its sources;
                   paper_prompts.py reads the papers' prompts from the user's copy of their source files
    baselines.py   trivial baselines (the whole video, ...): what a benchmark's numbers are worth without a model
    runner.py      evaluate_checkpoint / evaluate_loaded (a model in memory: training's held-out evaluation,
                   mmpg/train/heldout.py): shard over ranks, resume from predictions.jsonl, finish the folder
    batches.py     the one decoding loop: fixed batches (a video's queries side by side, decoded once), greedy
                   answers from the shared-prefix engine, optionally in lockstep over ranks (ZeRO-3)
    run_dir.py     evaluate_run: every complete checkpoint of a training run, then over_steps.md|png
    markdown.py    report.md and over_steps.md (pure text)
    plots.py       PNGs through matplotlib's Agg backend, written atomically
    cli.py         the `mmpg eval` subcommand

The evaluation folder's format: docs/inspector.md ("An evaluation folder"); its names: mmpg/runs/evals.py.
"""
