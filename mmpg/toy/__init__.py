"""The toy world: everything mmpg builds for itself so that it runs, is tested and is shown without downloading a model
or a dataset.

    models.py     tiny, seeded, random-weight Qwen checkpoints (Qwen2.5-VL, Qwen3-VL, Qwen2, Qwen3)    mmpg make-tiny
    tokenizer.py  their byte-level BPE tokenizer trained here, shaped like Qwen's
    videos.py     synthetic grounding datasets, exact ground truth (a shape drawn only in its span)    mmpg synth
    scenes.py     what each synthetic video shows: its events, their spans and motions
    render.py     the drawing and H.264 encoding behind videos.py
    demo/         the default job: a tiny model learns grounding on easy videos on a CPU               mmpg demo

What the toy world builds goes through the same paths as a real checkpoint and a real dataset (`from_pretrained`,
the annotation loader, qwen-vl-utils), so the tests, the demo and the CPU benchmarks exercise the code a 7B run uses.
Nothing a real run needs imports it: the training, evaluation, data, model, rollout, serving, config and run-directory
packages and the inspector stay off `mmpg.toy` (tests/test_import_graph.py checks this); the tools (`mmpg.cli`,
`mmpg.bench`, `mmpg.doctor`, `mmpg.plan`) import it only inside the functions that need it.
"""
