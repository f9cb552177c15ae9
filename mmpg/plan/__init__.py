"""`mmpg plan`: the memory and time of a GRPO recipe on given devices, before renting them.

    gpus       GPU presets (memory, bf16 peak, bandwidth); the model's shape is `mmpg.models.geometry`
    memory     the per-device peak by part (model states, reference, activations, logits, vision, rollout K/V)
    timing     the step's seconds by phase from FLOPs (at a stated utilisation) and decode bytes (at a bandwidth)
    fit        the cheapest single changes that make a recipe fit, each with its new peak
    recipe     a resolved config + device count -> what one device runs
    cpu, measure, validate   the model checked against measured CPU peaks (`python -m mmpg.plan.validate`)
    published  the plan beside what users of other video-RL trainers reported
    whole      the whole plan of a config as one dict (`mmpg plan --json`)
    run        a run's plan beside its measured perf/peak_memory_mb (`mmpg plan --run`, the inspector's memory card)
"""
