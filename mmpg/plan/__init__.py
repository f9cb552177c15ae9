"""`mmpg plan`: the memory and time of a GRPO recipe on given devices, before renting them.

    recipe     what one device runs (`Recipe`), from a resolved config and a device count
    memory     the per-device peak by part (model states, reference, activations, logits, vision, rollout K/V)
    timing     the step's seconds by phase from FLOPs and decode bytes; the GPU presets and this CPU's probed rates
    whole      the whole plan of a config as one dict (`mmpg plan --json`): memory, time, disk, what makes it fit; SFT
    published  the plan beside what users of other video-RL trainers reported
    validate   the memory model checked against measured CPU peaks (`python -m mmpg.plan.validate`)
    run        a run's plan beside its measured perf/peak_memory_mb (`mmpg plan --run`, the inspector's memory card)
    cli        the `mmpg plan` command
The model's shape is `mmpg.models.geometry`.
"""
