# mmpg on NVIDIA GPUs: CUDA devel base (nvcc for flash-attn and DeepSpeed's JIT ops), torch, flash-attn, DeepSpeed,
# mmpg installed editable in /workspace/mmpg/.venv by the same scripts/env.sh the launch scripts source.
#   docker build -t mmpg .
#   docker run --gpus all --ipc=host mmpg                                 mmpg --help (the default: the commands)
#   docker run --gpus all --ipc=host -v "$PWD/data:/workspace/mmpg/data" mmpg scripts/train_grounding.sh ...
#   docker run --gpus all --ipc=host -v "$PWD/data:/workspace/mmpg/data" mmpg scripts/bench.sh --preset gpu
#   docker run -it --gpus all --ipc=host mmpg -i                          a shell
#   docker run --gpus all --ipc=host mmpg -c "mmpg doctor --out /tmp/doctor"      check every GPU path, a report
# The entrypoint is bash, so any launch script (or `-c "mmpg ..."`) is the command. The default prints what there is
# to run and exits at once, on any host, with or without a GPU or mounted data (the demo is a CPU job of minutes:
# scripts/demo.sh; `mmpg doctor` checks every GPU path of the container on tiny models and writes a report).
#
# CUDA versions must line up three ways:
#   * the base image's nvcc has torch's CUDA major: torch 2.14.1 from PyPI is built for CUDA 13.0 (torch.version.cuda;
#     its wheel depends on cuda-toolkit 13.0.x), and flash-attn's source build refuses an nvcc of another major;
#   * the host driver runs that CUDA: CUDA 13.0 needs driver 580 or newer. On an older driver torch sees no GPU;
#     `mmpg doctor` then says so (driver's CUDA vs torch's) in its CUDA row. For such hosts build with
#     --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04 and torch 2.14.1's CUDA 12.6 build (drivers
#     >= 525; torch 2.14 has no 12.8 build) via --build-arg MMPG_TORCH="torch==2.14.1+cu126 torchvision==0.29.1+cu126
#     --index-url https://download.pytorch.org/whl/cu126" (docs/install.md, "torch for your driver");
#   * flash-attn compiles the architectures in FLASH_ATTN_CUDA_ARCHS (it ignores TORCH_CUDA_ARCH_LIST; unset, it
#     builds four): 80 = A100, 90 = H100/H200. Fewer architectures, shorter build.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG MMPG_TORCH="torch==2.14.1 torchvision==0.29.1"
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    MAX_JOBS=8 \
    MMPG_TORCH=${MMPG_TORCH} \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} \
    TORCH_CUDA_ARCH_LIST="8.0;9.0"

# ffmpeg libraries for decord / PyAV video decoding; git for pip VCS metadata. Unpinned on purpose: the base image
# fixes the Ubuntu release, and pinned apt versions break as soon as the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git ffmpeg ninja-build \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/mmpg
# dependencies first (a layer that survives code edits): env.sh installs torch, mmpg[dev] and its deps, then
# flash-attn with --no-build-isolation against that torch (the gpu extra); the check below fails the build if torch
# and nvcc disagree on the CUDA major, before the long flash-attn compile would.
COPY pyproject.toml setup.py README.md ./
COPY scripts/env.sh scripts/env.sh
RUN mkdir -p mmpg app && touch mmpg/__init__.py app/__init__.py \
    && bash -c 'source scripts/env.sh dev' \
    && nvcc_major="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')" \
    && torch_major="$(.venv/bin/python -c 'import torch; print(torch.version.cuda.split(".")[0])')" \
    && if [ "$nvcc_major" != "$torch_major" ]; then \
         echo "nvcc is CUDA $nvcc_major but torch is built for CUDA $torch_major: set CUDA_IMAGE to match" >&2; exit 1; fi \
    && bash -c 'source scripts/env.sh dev,gpu'

COPY . .
# re-register the editable install over the real sources (fast: dependencies are already there)
RUN .venv/bin/python -m pip install --no-deps -e ".[dev]"

# (DL3064 flags TOKENIZERS_PARALLELISM for its "TOKEN": no secret here)
# hadolint ignore=DL3064
ENV PATH=/workspace/mmpg/.venv/bin:$PATH \
    FORCE_QWENVL_VIDEO_READER=decord \
    TOKENIZERS_PARALLELISM=false \
    TORCH_EXTENSIONS_DIR=/workspace/mmpg/.cache/torch_extensions
ENTRYPOINT ["/bin/bash"]
CMD ["-c", "mmpg --help"]
