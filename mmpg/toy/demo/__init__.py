"""The default job (`mmpg demo`, `bash scripts/demo.sh`): watch a tiny video model learn temporal grounding on a CPU.

    build (once)    a tiny random-weight Qwen2.5-VL (hidden 128, 2 layers) and 400 easy synthetic videos
                    (one white shape on black, 8-20 s, whole-second spans; 280 train / 60 val / 60 test)
    check           grouped vs repeated forward on one prompt (the exactness the trainer relies on)
    evaluate        the untrained model on the held-out test split             (`mmpg eval`'s code)
    warm start      supervised fine-tuning on the train split                  (`mmpg sft`, its own process)
    evaluate        the SFT checkpoint
    GRPO            group-relative RL from the SFT checkpoint, reward format + tIoU·distance (`mmpg train`)
    evaluate        the GRPO checkpoint
    report          the three evaluations beside two trivial baselines (whole video, mean training span), the reward
                    curve (text and PNG), and where to look next (`mmpg inspect RUN_DIR`, the eval reports)

Every stage is the code a 7B run uses — the same config tree, DeepSpeed engine, run directory, rollout, reward,
grouped forward and evaluation; only the sizes are small. The task is easy enough for a 0.5M-parameter model to
learn in minutes, but nothing goes around the video, the prompt or the reward: the model has to find the seconds
the shape is visible in its frames and write them as text.
"""

from mmpg.toy.demo.pipeline import PRESETS, Preset, run_demo

__all__ = ["PRESETS", "Preset", "run_demo"]
