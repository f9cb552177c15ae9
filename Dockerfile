# mmpg on NVIDIA GPUs: CUDA devel base (nvcc for flash-attn and DeepSpeed's JIT ops), torch, flash-attn, DeepSpeed,
# mmpg installed editable in /workspace/mmpg/.venv by the same scripts/env.sh the launch scripts source.
#   docker build -t mmpg .
#   docker run --gpus all --ipc=host mmpg                                 scripts/gpu_check.sh (the default)
#   docker run --gpus all --ipc=host -v "$PWD/data:/workspace/mmpg/data" mmpg scripts/bench.sh --preset gpu
# The entrypoint is bash, so any launch script (or `-c "mmpg ..."`) is the command.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    MAX_JOBS=8 \
    TORCH_CUDA_ARCH_LIST="8.0;9.0"

# ffmpeg libraries for decord / PyAV video decoding; git for pip VCS metadata. Unpinned on purpose: the base image
# fixes the Ubuntu release, and pinned apt versions break as soon as the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ffmpeg ninja-build \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/mmpg
# dependencies first (a layer that survives code edits): pyproject + env.sh install torch, mmpg[dev] and its deps
COPY pyproject.toml README.md ./
COPY scripts/env.sh scripts/env.sh
RUN mkdir -p mmpg app && touch mmpg/__init__.py app/__init__.py \
    && bash -c 'source scripts/env.sh dev' \
    && .venv/bin/python -m pip install packaging psutil ninja wheel \
    && .venv/bin/python -m pip install --no-build-isolation "flash-attn>=2.7"

COPY . .
# re-register the editable install over the real sources (fast: dependencies are already there)
RUN .venv/bin/python -m pip install --no-deps -e ".[dev,gpu]"

# (DL3064 flags TOKENIZERS_PARALLELISM for its "TOKEN": no secret here)
# hadolint ignore=DL3064
ENV PATH=/workspace/mmpg/.venv/bin:$PATH \
    FORCE_QWENVL_VIDEO_READER=decord \
    TOKENIZERS_PARALLELISM=false \
    TORCH_EXTENSIONS_DIR=/workspace/mmpg/.cache/torch_extensions
ENTRYPOINT ["/bin/bash"]
CMD ["scripts/gpu_check.sh"]
