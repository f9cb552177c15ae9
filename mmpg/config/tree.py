"""One typed config tree for every mmpg job: defaults <- YAML file <- `a.b=c` overrides on the command line.

    cfg = load_config("configs/cpu_demo.yaml", ["rollout.n=4", "optim.lr=1e-5"])   # -> Config (dataclasses)

The merge and the type checks are OmegaConf's (structured configs, as EasyR1 and verl use them). An unknown key or a
value of the wrong type becomes one `UserError` line naming the key and the nearest valid names; the CLI prints it
and exits with status 2. Every field carries its help text in `metadata["help"]`; `describe()` prints them
(`mmpg train --fields [GROUP]`). Names follow what users of verl / TRL / EasyR1 know where that is possible
(`rollout.n`, `algorithm.beta`, `algorithm.epsilon_high`, `algorithm.num_iterations`, `data.batch_size`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


def setting(default, help: str, **kw):
    """A field with a default and its help text (lists and dicts get a default_factory). Every field of the tree and
    of the eval settings (`mmpg.eval.settings`) is one."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)




@dataclass
class VideoSettings:
    """How a video becomes frames, one block for training (`data.fps`, ...) and evaluation (`mmpg eval fps=...`):
    DataConfig and EvalSettings inherit these fields (the keys stay where they were; a subclass may override a
    default). Checked by `mmpg.config.checks.video_checks`; `video_values()` is what `VideoSpec.for_family` takes."""

    fps: float = setting(2.0, "Frames sampled per second of video, before min_frames / max_frames (Time-R1: 2).")
    min_frames: int = setting(4, "Fewest frames per video (>= 2: two frames make one temporal patch).")
    max_frames: int = setting(64, "Most frames per video; long videos get a lower effective fps.")
    min_pixels: Optional[int] = setting(None, "Smallest H*W of a frame (null: 16 tokens per frame).")
    max_pixels: Optional[int] = setting(None, "Largest H*W of a frame (null: 256 tokens per frame).")
    total_pixels: Optional[int] = setting(None, "Pixel budget of a whole video, shared by its frames (null: 8192 "
                                          "tokens).")

    def video_values(self) -> dict:
        """{fps, min_frames, max_frames, min_pixels, max_pixels, total_pixels} of this block."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(VideoSettings)}


# The language model's attention and MLP projections (leaf names, matched inside the text model only).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    r: int = setting(0, "LoRA rank (peft): 0 = off (full fine-tuning); > 0 trains only low-rank adapters on "
                     "target_modules, the base weights frozen (mmpg/models/lora.py).")
    alpha: int = setting(16, "LoRA scaling numerator: the adapter's update is multiplied by alpha / r.")
    dropout: float = setting(0.0, "Dropout on the adapters' input in the update's forward (0: none). The rollout, the "
                             "self-check and the old / reference logprobs run without it "
                             "(mmpg.models.lora.without_dropout), so actor/logprob_gap_* then include the dropout's "
                             "noise.")
    target_modules: list = setting(LORA_TARGETS, "Modules that get adapters. A name without a dot is a leaf name "
                                   "matched inside the language model only (q_proj matches every text layer's q_proj, "
                                   "never the vision tower's); a dotted name is matched as a suffix of full module "
                                   "names anywhere, which is how vision modules are named explicitly (e.g. "
                                   "visual.merger.mlp.0; needs model.freeze_vision=false). An entry that matches "
                                   "nothing is an error.")


@dataclass
class ModelConfig:
    path: str = setting("", "The policy: a checkpoint folder (HF format: config.json, weights, processor) or a hub id "
                        "(Qwen/Qwen2.5-VL-7B-Instruct: its snapshot in the Hugging Face cache, downloaded on first "
                        "use, once per node; run.json records its commit). Required.")
    dtype: str = setting("auto", "Weights and compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32, "
                         "bfloat16.")
    attn_implementation: str = setting("sdpa", "transformers attention for ordinary forwards: auto (flash_attention_2 "
                                       "on CUDA when flash-attn imports, else sdpa), sdpa, eager, flash_attention_2 "
                                       "(sdpa with a warning when flash-attn is missing); the grouped forward "
                                       "registers its own on top.")
    grouping_backend: str = setting("auto", "Grouped forward's attention backend (training, SFT, the rollout's shared "
                                    "prefill, the bench): auto (flash on CUDA in bf16/fp16 when a usable flash-attn "
                                    "2.7+ is installed, else sdpa), sdpa (exact everywhere), flash (FlashAttention "
                                    "varlen, no G-fold K/V copy), flex (FlexAttention block mask, compiled). A flash "
                                    "or flex backend that fails the self-check (or raises) falls back to sdpa with "
                                    "one warning line.")
    deterministic: bool = setting(False, "Deterministic attention backward: flash-attn's deterministic=True in the "
                                  "grouped flash backend (and FLASH_ATTENTION_DETERMINISTIC=1 for transformers' own "
                                  "flash_attention_2). Needed for bit-identical resume on a GPU with flash; costs "
                                  "some backward speed. CPU runs are deterministic anyway; torch's own GPU sdpa "
                                  "kernels follow torch.use_deterministic_algorithms, which this does not set.")
    gradient_checkpointing: bool = setting(False, "Recompute decoder activations in backward (less memory, ~30% more "
                                           "compute).")
    freeze_vision: bool = setting(True, "No gradients for the vision tower (common for grounding RL; it still runs "
                                  "once per prompt). With model.lora.r > 0 only adapters train anyway; false lets "
                                  "model.lora.target_modules name vision modules.")
    train_merger: bool = setting(False, "With model.freeze_vision: the vision tower's patch merger (visual.merger, "
                                 "the MLP that maps merged patches to the language model's width) still trains, the "
                                 "rest of the tower stays frozen (Time-R1's fix_vit, TimeLens's freeze_vision_tower "
                                 "with the merger trained). Needs freeze_vision=true and full fine-tuning "
                                 "(model.lora.r=0).")
    ref_path: str = setting("", "Reference policy for the KL penalty (only loaded when algorithm.beta > 0); empty = "
                            "model.path. With LoRA, empty (or model.path itself) means the policy with its adapters "
                            "switched off, no second model loaded; another folder is loaded as the reference.")
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapters on the language model "
                                                                   "(peft); r=0: off."})


@dataclass
class DataConfig(VideoSettings):
    # fps, min_frames, max_frames, min_pixels, max_pixels, total_pixels: VideoSettings' (data.fps, ...)
    train: str = setting("", "Training annotations (Charades-STA txt/JSON, ActivityNet JSON, Time-R1 list, JSONL).")
    val: str = setting("", "Held-out annotations for eval.every_n_steps (empty: no evaluation during training).")
    videos: str = setting("", "Folder holding the videos the annotations name.")
    format: str = setting("auto", "Annotation format: auto, charades (txt), captions (Charades-STA / ActivityNet "
                          "JSON), time_r1, tvgbench, jsonl (data/README.md).")
    template: str = setting("time_r1", "Prompt template: time_r1, time_r1_frames, answer_only, or zoom (multi-turn: "
                            "the prompt offers the zoom tool, zoom.*).")
    batch_size: int = setting(8, "Prompts per training step over all ranks (each gets rollout.n responses).")
    num_workers: int = setting(2, "DataLoader workers decoding videos (0: in the main process).")
    shuffle: bool = setting(True, "Shuffle the training samples (a new order every epoch, from trainer.seed).")
    queries_per_video: int = setting(1, "Keep up to K queries of one video side by side in the epoch order (1: i.i.d. "
                                     "order); side by side they share the video in the grouped forward, each query "
                                     "still once per epoch (mmpg/train/data.py).")
    strict: bool = setting(False, "Stop at the first unusable sample with an error naming it, instead of skipping and "
                           "counting it.")
    max_samples: int = setting(0, "Use only the first N training samples (0: all).")
    frame_cache: str = setting("", "Folder of the decoded-frame cache, on local disk (empty: off): a video's frames "
                               "after sampling and resizing, kept as raw uint8 keyed by the file (path, size, mtime) "
                               "and every setting that changes them, so later epochs (and evaluation during "
                               "training) read them instead of decoding. `mmpg prepare-videos` fills it before a run "
                               "(mmpg/data/frame_cache.py, docs/data.md).")
    frame_cache_gb: float = setting(100.0, "Most gigabytes (10^9 bytes) data.frame_cache may hold; past it the least "
                                    "recently used entries are deleted. At the long config a video takes at most "
                                    "~300 MB, an hour of footage 0.3-2.1 GB (docs/data.md).")


@dataclass
class RolloutConfig:
    n: int = setting(8, "Group size G: responses sampled per prompt (>= 2).")
    temperature: float = setting(1.0, "Sampling temperature (the logprobs of the loss use the same one).")
    top_p: float = setting(1.0, "Nucleus sampling (1: off).")
    top_k: int = setting(0, "Top-k sampling (0: off).")
    max_new_tokens: int = setting(256, "Most tokens per response, the stop token included.")
    engine: str = setting("hf", "Rollout engine: hf (the training model itself, each prompt prefilled once) or vllm "
                          "(a `mmpg vllm-serve` server in its own venv; weights synced after every optimizer step).")
    decode: str = setting("auto", "How the hf engine decodes behind the shared prefix: cascade (each prompt's K/V "
                          "held and read once per step, each row's own tokens apart, merged by log-sum-exp), copy "
                          "(the prefill's K/V copied G ways; same tokens, more memory and time on long prompts), or "
                          "auto (cascade, its kernel checked as rollout.decode_check says; "
                          "mmpg.rollout.decode_choice).")
    cascade_backend: str = setting("auto", "Cascade decoding's attention kernel: auto (CUDA: flash when a usable "
                                   "flash-attn 2.7+ is installed and the model is bf16/fp16, else sdpa, else math; "
                                   "CPU: sdpa), flash (flash-attn's kvcache kernel with its LSE), sdpa (torch's "
                                   "kernel with its LSE), math (float32 matmuls, any device). A kernel that fails its "
                                   "check steps down the chain to copy decoding with one warning line.")
    decode_check: str = setting("auto", "Check the cascade kernel against copy decoding on the run's first batch and "
                                "when a batch's longest prompt or largest group grows (greedy, 4 tokens of 2 prompts: "
                                "same tokens, logprobs within the dtype's bound): auto (on for CUDA, off on the CPU, "
                                "where the kernels are tested), on, off. The choice is recorded as decode_kernel.")
    prefill_chunk: int = setting(8192, "hf engine: a prompt longer than this many tokens is prefilled in chunks of it "
                                 "behind the cache, and its video encoded in frame chunks of at most this many "
                                 "tokens, so the prefill's activation peak follows the chunk, not the video (same "
                                 "tokens; mmpg.rollout.chunks; mmpg eval has its own prefill_chunk setting). 8192: "
                                 "typical grounding prompts (a few thousand tokens) keep the one-forward path, and a "
                                 "chunk that long is compute-bound on a GPU, so extra chunks cost little time. 0: "
                                 "never chunk.")
    vllm_url: str = setting("http://127.0.0.1:8000", "rollout.engine=vllm: address of the `mmpg vllm-serve` server "
                            "(scripts/vllm_serve.sh), or a pool's, comma-separated (data rank r samples from server "
                            "r mod N; rank 0 syncs every server). A server must see the trainer's files (weight sync "
                            "goes through one) unless it syncs by NCCL (one server).")
    vllm_timeout_s: float = setting(600.0, "rollout.engine=vllm: most seconds one request (a rollout batch, a weight "
                                    "update) may take before the step fails with a clear error instead of hanging.")
    vllm_sync_timeout_s: float = setting(300.0, "rollout.engine=vllm: most seconds one weight sync may take (the NCCL "
                                         "rendezvous, the broadcast and the server's load, or the file's load); past "
                                         "it, or at once when the server refuses, every rank stops with one error "
                                         "line.")
    vllm_wait_s: float = setting(300.0, "rollout.engine=vllm: most seconds the trainer waits at start for the server "
                                 "to come up (it loads the model first).")
    tis_cap: float = setting(0.0, "Truncated importance sampling for the rollout/training mismatch: each token's loss "
                             "is weighted by min(pi_train_old / pi_rollout, tis_cap) (useful with "
                             "rollout.engine=vllm); 0: off.")
    max_staleness: int = setting(0, "Rollout/training overlap (rollout.engine=vllm): 0 samples each step's groups "
                                 "after the previous update (synchronous); k >= 1 lets the server sample the next "
                                 "steps' groups while the trainer updates, each with weights at most k steps old "
                                 "(needs rollout.tis_cap > 0: the loss weighs each token by the capped ratio of the "
                                 "current policy to the one that sampled it).")


@dataclass
class RewardConfig:
    accuracy: str = setting("iou_v2", "Accuracy reward: iou_v2 (Time-R1) or iou.")
    format_weight: float = setting(1.0, "Weight of the format reward (<think>..</think><answer>..</answer>).")
    accuracy_weight: float = setting(1.0, "Weight of the accuracy reward.")
    swap_reversed: bool = setting(False, "Read an answer 'END to START' as START to END instead of unparseable.")
    function: str = setting("", "A user reward 'package.module:function' (response, sample) -> dict or float, used "
                            "instead of the built-in one.")


@dataclass
class AlgorithmConfig:
    loss_type: str = setting("grpo", "grpo (mean of per-sequence token means), dapo (token mean over the batch), "
                             "dr_grpo (token sum / (sequences x rollout.max_new_tokens)).")
    scale_rewards: str = setting("group", "Advantage scaling: group (divide by the group's std), batch (by the batch "
                                 "std), none (Dr. GRPO).")
    epsilon_low: float = setting(0.2, "PPO clip: ratio floor 1 - epsilon_low.")
    epsilon_high: float = setting(0.2, "PPO clip: ratio ceiling 1 + epsilon_high (DAPO clip-higher: 0.28).")
    beta: float = setting(0.0, "KL penalty weight (k3 estimator) against the frozen reference; 0: no reference model.")
    num_iterations: int = setting(1, "mu: optimisation passes over each rollout batch (1: no extra forward).")
    mask_truncated: bool = setting(False, "Leave responses that hit max_new_tokens out of the loss (DAPO).")
    dynamic_sampling: bool = setting(False, "Drop groups whose rewards are all equal and draw more prompts (DAPO).")
    max_sampling_rounds: int = setting(4, "Dynamic sampling: most rollout rounds per step before training on what "
                                       "there is.")
    grouping: bool = setting(True, "Shared-prefix grouped forward; false: the naive repeated forward (A/B runs).")
    share_videos: bool = setting(True, "Adjacent prompts of one video (data.queries_per_video) share the video's part "
                                 "of the prompt: in the grouped forward (mmpg.grouping.shares) and the hf rollout's "
                                 "cascade prefill and decode (mmpg.rollout.shares; not under rollout.decode=copy, or "
                                 "when the cascade kernels all failed their check); false: each prompt alone.")
    self_check: str = setting("on", "Compare the grouped forward with the repeated one on one of the step's own "
                              "micro-batches (logprobs, a leak probe, and logprobs and gradients with autograd "
                              "recording), in this run's dtype, backend and versions, at the first step and whenever "
                              "a batch goes past the prompt / response / group sizes checked so far "
                              "(mmpg.grouping.selfcheck): on (stop the run on a figure above its bound), warn (log it "
                              "and go on), off. Stops and warnings go to train.log and run.json's fast_paths.")


@dataclass
class OptimConfig:
    lr: float = setting(1e-6, "Peak learning rate (AdamW).")
    betas: list = setting([0.9, 0.999], "AdamW betas.")
    eps: float = setting(1e-8, "AdamW epsilon.")
    weight_decay: float = setting(0.01, "AdamW weight decay.")
    warmup_steps: int = setting(0, "Linear warm-up optimizer steps.")
    scheduler: str = setting("constant", "LR after warm-up: constant, cosine or linear (to min_lr_ratio x lr at the "
                             "end; linear to 0 is the transformers / TRL default).")
    min_lr_ratio: float = setting(0.0, "Cosine or linear floor as a fraction of lr.")
    max_grad_norm: float = setting(1.0, "Gradient clipping by global norm (0: off).")


@dataclass
class TrainerConfig:
    total_steps: int = setting(100, "Training steps (one rollout batch each).")
    micro_batch_size: int = setting(8, "Responses per forward/backward on one rank; a multiple of rollout.n (groups "
                                    "stay whole inside a micro-batch, as the grouped forward needs).")
    seed: int = setting(0, "Seeds data order, sampling and initialisation.")
    output_dir: str = setting("runs", "Where run directories are created.")
    run_name: str = setting("", "Run directory name under output_dir (empty: a time stamp; with "
                            "checkpoint.resume=auto, the newest run of the same --config and job that has a "
                            "checkpoint).")
    device: str = setting("auto", "auto (cuda when available), cpu or cuda.")


@dataclass
class DeepSpeedConfig:
    zero_stage: int = setting(0, "ZeRO stage 0-3 (ignored when config is given).")
    config: str = setting("", "A DeepSpeed JSON file (configs/deepspeed/zero{1,2,3}.json); batch sizes, clipping and "
                          "precision are filled in from this config tree.")
    offload: bool = setting(False, "ZeRO-3 with optimizer and parameters offloaded to CPU memory.")
    timeout_minutes: int = setting(30, "Collective timeout: a rank that waits longer fails instead of hanging.")


@dataclass
class ParallelConfig:
    sequence_parallel_size: int = setting(1, "Ranks that share each packed row (sequence parallelism, for videos too "
                                          "long for one device): the W ranks form W/sp groups of sp consecutive "
                                          "ranks; the ranks of a group take the same samples, split their rollouts, "
                                          "and each holds 1/sp of every packed row (Ulysses attention over the "
                                          "grouped layout) and encodes 1/sp of every video's frames. Must divide the "
                                          "ranks and the model's attention heads; data.batch_size is then split over "
                                          "W/sp groups. 1: off.")


@dataclass
class LoggingConfig:
    tensorboard: bool = setting(True, "Write TensorBoard events under RUN_DIR/tb.")
    wandb: bool = setting(False, "Also log to Weights & Biases (needs the wandb package and a login).")
    wandb_project: str = setting("mmpg", "wandb project name.")
    rollouts_every: int = setting(1, "Write rollouts/step_*.jsonl every N steps (0: never).")
    thumbnails: int = setting(4, "Frame thumbnails stored per video for the inspector (0: none).")
    rollout_logprobs: bool = setting(False, "Rollout records also carry each response's token ids, the sampling "
                                     "engine's logprobs and the trainer's recompute before the update (to audit the "
                                     "off-policy weights of rollout.tis_cap / rollout.max_staleness; about 3x larger "
                                     "records).")


@dataclass
class CheckpointConfig:
    every_n_steps: int = setting(50, "Save a checkpoint every N steps (and at the end; 0: only at the end).")
    keep_last: int = setting(2, "Keep the newest K checkpoints (0: keep all).")
    optimizer_state: str = setting("last", "Which checkpoints keep the optimizer state (AdamW moments + fp32 master "
                                   "copy, 12 bytes per trained parameter; deepspeed/): last (the newest, so a resume "
                                   "continues exactly; older kept ones become weights-only once a newer one is "
                                   "complete), all, or none (weights only: a resume restarts AdamW's moments, and "
                                   "says so). `mmpg plan` prints the sizes and the disk a run needs.")
    resume: str = setting("", "'auto' (the latest complete checkpoint of the run trainer.run_name names; without a "
                          "name, of the newest run of the same --config and job under trainer.output_dir, named in "
                          "one line), a checkpoint folder, or empty.")


@dataclass
class EvalConfig:
    every_n_steps: int = setting(0, "Evaluate data.val every N steps (0: never).")
    max_samples: int = setting(64, "Held-out samples per evaluation (0: all).")
    batch_size: int = setting(8, "Prompts per greedy decoding batch.")
    share_videos: bool = setting(True, "Batch a video's queries together (whole videos up to batch_size queries), so "
                                 "each video is decoded once per batch and, with cascade decoding (the default; copy "
                                 "decoding does not share), encoded and prefilled once; false: fixed batches in "
                                 "annotation order (mmpg eval's share_videos).")
    max_new_tokens: int = setting(256, "Most tokens per answer.")


@dataclass
class SFTConfig:
    think: str = setting("I watch the frames and find when the described moment starts and ends.", "Text inside "
                         "<think>..</think> of the supervised target (used when the prompt template asks for "
                         "reasoning); the answer follows as <answer>START to END</answer>.")
    decimals: int = setting(2, "Decimals of the target times (trailing zeros dropped: 12.5, 17).")
    trajectories: str = setting("", "Multi-turn trajectories to train on instead of data.train's answers (JSON Lines: "
                                "the model's turns, its zoom calls and the tool's turns; `mmpg synth --zoom` writes "
                                "trajectories.jsonl; mmpg/sft/trajectories.py): the zoom tool's cold start. Needs "
                                "data.template=zoom; video paths relative to data.videos, else to the file's folder.")
    list_tools: bool = setting(True, "With sft.trajectories: false leaves the tool's schema out of the system turn "
                               "(the prompt's text still offers the zoom tool): the first stage of a cold start for "
                               "a model that does not yet read the video behind a system turn; the next stage, "
                               "rollouts and mmpg eval list it (docs/performance.md).")


@dataclass
class ZoomConfig:
    fps: float = setting(4.0, "The zoom tool's frame rate (data.template=zoom offers the tool): a window the model "
                         "asks for comes back as its frames at this rate, sized as data.* sizes frames "
                         "(mmpg/rollout/zoom.py).")
    max_frames: int = setting(16, "Most frames one zoom returns: windows of at most max_frames / fps seconds; a "
                              "longer one gets an error turn.")
    max_turns: int = setting(2, "Most tool turns in one trajectory; a call past them ends the trajectory "
                             "unanswered.")
    call_cost: float = setting(0.0, "GRPO: reward subtracted per zoom that returned a clip (so the policy learns when "
                               "one look is enough); logged as reward/zoom_cost.")
    error_penalty: float = setting(0.0, "GRPO: reward subtracted per error turn (a malformed call, a window outside "
                                   "the video or longer than zoom.max_frames show); reward/zoom_error_penalty.")
    window_weight: float = setting(0.0, "GRPO: weight of the last zoom window's tIoU with the truth, added to the "
                                   "reward (a guard against zooming on the whole video); reward/zoom_window.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    zoom: ZoomConfig = field(default_factory=ZoomConfig)

    def lists_tools(self, kind: str) -> bool:
        """Whether a `kind` ("sft" or "grpo") run's prompt lists the tool's schema in its system turn: an SFT stage
        with `sft.list_tools: false` leaves it out, for its training and its held-out evaluation alike; rollouts
        always list it (sft.* is not a GRPO run's config)."""
        return kind != "sft" or self.sft.list_tools


GROUPS = [f.name for f in dataclasses.fields(Config)]


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the tree, e.g. 'rollout.n'."""
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys += all_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys
