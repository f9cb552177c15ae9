"""mmpg.eval: grounding benchmarks for checkpoints (never imports mmpg.train, mmpg.rl or mmpg.sft; reads runs through
mmpg.runs; its collectives come from mmpg.dist).

    metrics.py     pure: R1@{0.3,0.5,0.7} under both conventions (tIoU > m: Time-R1, >= m: VideoChat-R1), mIoU,
                   answers scored as the protocol says (scoring mmpg: mmpg.rewards.parse_answer; last_span: the
                   papers' parser and raw-span IoU); unparseable = IoU 0
    settings.py    EvalSettings: defaults <- protocol preset <- key=value (OmegaConf, one-line errors)
    protocols.py   named presets (default, time_r1, videochat_r1, tvgbench), each naming where its numbers come
                   from; the papers' prompts come from the user's prompt_file
    runner.py      evaluate_checkpoint / evaluate_loaded (a model in memory: training's held-out evaluation,
                   mmpg/train/heldout.py): shard over ranks, resume from predictions.jsonl, finish the folder
    batches.py     the one decoding loop: fixed batches (share_videos: whole videos, a video's queries side by
                   side, decoded once), greedy answers from the shared-prefix engine (group size 1, temperature
                   0), optionally in lockstep over ranks (ZeRO-3); the decoding's counts (videos, vision-tower
                   encodes, prefill tokens)
    run_dir.py     evaluate_run: every complete checkpoint of a training run, then over_steps.md|png
    markdown.py    report.md and over_steps.md (pure text)
    plots.py       PNGs through matplotlib's Agg backend, written atomically
    cli.py         the `mmpg eval` subcommand

The evaluation folder's layout is documented once, in mmpg/runs/evals.py.
"""
