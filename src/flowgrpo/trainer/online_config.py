"""OnlineRLConfig: the settings every online-RL trainer here shares, as a `transformers.TrainingArguments` subclass.

Groups and batches, rollouts (resolution, steps, guidance, prompts), rewards and advantages, the reference penalty
weight ``beta``, memory savers, crash safety, logging and the optimizer defaults. Each trainer's config adds its own
algorithm on top: `FlowGRPOConfig` (the stochastic sampler, its windows and the clipped objective) and
`DiffusionNFTConfig` (the deterministic sampler, the negative-aware loss and the old policy). Defaults follow the
published Flow-GRPO recipes for Stable Diffusion 3.5 Medium where they exist; a trainer's config overrides the ones
its algorithm publishes differently (DiffusionNFT: CFG-free rollouts, a smaller ``beta``).

The generation settings (``resolution`` / ``height`` / ``width``, ``num_inference_steps``, ``eval_num_inference_steps``,
``guidance_scale``, ``eval_guidance_scale``, ``max_sequence_length``, ``num_frames``) default to ``None``: the model's
own, resolved by the trainer from the pipeline's component configs before anything is loaded
(:mod:`flowgrpo.models.defaults`) and written back here. Checks that need them (a step count for an SDE window, ...)
run when they are given, and again once they are resolved (``_check_generation_settings``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import ClassVar

from transformers import TrainingArguments

from .config_docs import document_config
from .health.arguments import HealthArguments, check_health_arguments

SCALE_REWARDS = ("batch", "group", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("4bit", "8bit")
REWARD_AGGREGATIONS = ("weighted_sum", "normalize_then_sum")


def check_choice(name: str, value, choices) -> None:
    """Raise a ValueError naming ``name``, its value and the valid ``choices`` unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}.")


@document_config
@dataclass
class OnlineRLConfig(HealthArguments, TrainingArguments):
    r"""The settings shared by [`FlowGRPOConfig`] and [`DiffusionNFTConfig`].

    Batch vocabulary (as in TRL's GRPO): a *micro-batch* is ``per_device_train_batch_size`` images on one
    process; a *generation batch* holds ``generation_batch_size`` images over all processes, i.e.
    ``generation_batch_size / num_generations`` prompts each sampled ``num_generations`` times. One
    generation batch is sampled, scored and then trained on for ``steps_per_generation`` micro-batches per
    process (times ``num_iterations`` passes). The defaults give one generation per optimizer step.
    """

    # ---- groups and batches --------------------------------------------------------------------------
    num_generations: int = field(
        default=8,
        metadata={"help": "Group size G: images sampled per prompt with different noise. Advantages compare each "
                          "image with the other members of its group. Must be >= 2. Default 8 as in the "
                          "Flow-GRPO-Fast SD3.5-M configuration (8 prompts x 8 images)."},
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Images per generation batch over all processes. Defaults to per_device_train_batch_size x "
                          "num_processes x steps_per_generation (num_processes / sequence_parallel_size: the processes "
                          "of a sequence-parallel group share their samples). Must be divisible by num_generations. "
                          "Mutually exclusive with steps_per_generation."},
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-batches trained per process on each generation batch. Defaults to "
                          "gradient_accumulation_steps, i.e. one generation batch per optimizer step."},
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Passes over each generation batch. 1 trains each sample once (Flow-GRPO, DiffusionNFT); "
                          ">1 reuses samples (for Flow-GRPO this makes the clipped ratio matter)."},
    )

    # ---- sampling ------------------------------------------------------------------------------------
    resolution: int | None = field(
        default=None,
        metadata={"help": "Square image side in pixels (SD3.5-M Flow-GRPO recipes: 512). Overridden by height/width. "
                          "Unset: the model's own size (its pipeline's default_sample_size x VAE factor, or the "
                          "checkpoint's generation_defaults; the toy world: 32)."},
    )
    height: int | None = field(default=None, metadata={"help": "Image height; defaults to resolution, else the "
                                                               "model's own."})
    width: int | None = field(default=None, metadata={"help": "Image width; defaults to resolution, else the "
                                                              "model's own."})
    num_frames: int | None = field(
        default=None,
        metadata={"help": "Frames per sample: 1 for image families (SD3, FLUX, Qwen-Image, the editing models); video "
                          "families need their own counts (Wan: 4k + 1, e.g. 81 as released, 33 or 5 for small runs). "
                          "Unset: the model's own (1, or the video pipeline's default). The family's rule is checked "
                          "as soon as the pipeline's class is known, before loading it."},
    )
    num_inference_steps: int | None = field(
        default=None,
        metadata={"help": "Sampling steps of training rollouts (Flow-GRPO trains SD3.5-M with 10 and evaluates with "
                          "40). Unset: the model card's steps (distilled models: their few steps)."},
    )
    eval_num_inference_steps: int | None = field(
        default=None, metadata={"help": "ODE sampling steps for evaluation (Flow-GRPO: 40). Unset: the model card's."},
    )
    eval_images_per_prompt: int = field(
        default=1,
        metadata={"help": "Images per eval prompt, each from its own fixed seed. More images average out the "
                          "sampling noise of the eval metrics (a small eval set with one image per prompt moves by "
                          "several points between seeds)."},
    )
    guidance_scale: float | None = field(
        default=None,
        metadata={"help": "Classifier-free guidance scale of rollouts (SD3.5-M recipes: 4.5). 1.0 disables CFG: "
                          "one transformer pass per step (the CFG-free 'Fast' recipes). Training recomputes the "
                          "velocity with the same scale and negative embeddings. Unset: the model card's guidance "
                          "(distilled models: none; CFG-free algorithms: none)."},
    )
    eval_guidance_scale: float | None = field(
        default=None, metadata={"help": "Guidance scale for evaluation; defaults to guidance_scale (given or "
                                        "resolved)."},
    )
    eval_guidance_scales: list[float] | None = field(
        default=None,
        metadata={"help": "More guidance scales to evaluate at, besides eval_guidance_scale (e.g. [1.0, 3.0]): each "
                          "evaluation samples the eval set once per scale, with the same seeds. The metrics at "
                          "eval_guidance_scale keep their names (eval_reward, ...); those at another scale s are "
                          "named eval_cfg<s>_... (eval_cfg3_reward, eval_cfg3_rewards/<name>/mean, ...)."},
    )
    rollouts_at_eval_guidance: bool = field(
        default=False,
        metadata={"help": "Sample the training rollouts at eval_guidance_scale (which must be given) instead of "
                          "guidance_scale: the images trained on are then those the evaluation sees (a CFG-free "
                          "trainer otherwise rolls out at 1 and is evaluated at, say, 3). Only where the loss does not "
                          "read the sampling policy's own velocity: AWM, DGPO and online Diffusion-DPO, whose trained "
                          "velocity keeps train_guidance_scale; the other trainers refuse it with their reason (set "
                          "guidance_scale to roll out and train at the evaluation's scale)."},
    )
    negative_prompt: str = field(
        default="", metadata={"help": "Negative prompt for classifier-free guidance (SD3 recipes use the empty prompt)."},
    )
    max_sequence_length: int | None = field(
        default=None,
        metadata={"help": "Text token length of prompt embeddings (SD3 pipelines: 256 T5 tokens). Unset: the "
                          "pipeline's own length, capped by its text encoder's."},
    )

    # ---- objective -----------------------------------------------------------------------------------
    beta: float = field(
        default=0.04,
        metadata={"help": "KL weight to the reference policy (LoRA disabled, or a frozen copy for full "
                          "fine-tuning). Flow-GRPO SD3.5-M recipes: 0.04. 0 skips the reference pass."},
    )
    reward_aggregation: str = field(
        default="weighted_sum",
        metadata={"help": "How several rewards make one advantage: 'weighted_sum' (the weighted sum of rewards, "
                          "then group normalisation) or 'normalize_then_sum' (each reward normalised within its "
                          "group first, then the weighted sum of those advantages, so a hard reward is not drowned "
                          "by an easy one)."},
    )
    adv_clip_max: float = field(
        default=5.0, metadata={"help": "Advantages are clipped to [-adv_clip_max, adv_clip_max] (Flow-GRPO: 5)."},
    )
    scale_rewards: str = field(
        default="batch",
        metadata={"help": "Advantage scale: 'batch' divides by the std of the whole gathered batch (Flow-GRPO's "
                          "global std), 'group' by each group's std, 'none' by 1."},
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward function; the weighted sum is the training reward. Default: all 1."},
    )
    reward_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments per reward name, e.g. {'ocr': {'backend': 'rapidocr'}} (JSON string "
                          "accepted on the command line)."},
    )
    reward_on_failure: dict | str | None = field(
        default="raise",
        metadata={"help": "When a reward raises mid-run: 'raise' stops the run with a clear error after saving a "
                          "checkpoint of the last completed step; 'skip' scores that batch None for that reward "
                          "(excluded, logged as rewards/<name>/failed) and goes on. One policy for every reward, or a "
                          "mapping per reward name (JSON string on the command line), e.g. {'remote': 'skip'}. "
                          "'none' is accepted for 'skip'."},
    )

    # ---- model and memory ----------------------------------------------------------------------------
    dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the frozen pipeline components and the base transformer: 'float32', "
                          "'bfloat16', 'float16' or 'auto' (bfloat16 on CUDA, float32 otherwise). Trainable LoRA "
                          "weights are kept in float32."},
    )
    quantization: str | None = field(
        default=None,
        metadata={"help": "Load the base transformer quantized with bitsandbytes ('4bit' NF4 or '8bit') for LoRA "
                          "training on one consumer GPU. Needs CUDA and a LoRA peft_config."},
    )
    cache_prompt_embeddings: bool = field(
        default=False,
        metadata={"help": "Encode each distinct prompt once and keep its embeddings in host memory; later rollout and "
                          "evaluation batches reuse them (the text encoders are frozen, so an embedding never "
                          "changes). Cost per prompt: one row of every embedding tensor, e.g. 2.73 MB for SD3/3.5 at "
                          "max_sequence_length 256 in bf16 ((77 CLIP + 256 T5 tokens) x 4096 + pooled 2048)."},
    )
    prompt_cache_size: int = field(
        default=1024,
        metadata={"help": "Most prompts the embedding cache holds; the least recently used are dropped beyond it. "
                          "1024 SD3.5 prompts at 256 T5 tokens take about 2.8 GB of host memory per process."},
    )
    precompute_prompt_embeddings: bool = field(
        default=False,
        metadata={"help": "Fill the embedding cache with every prompt of train_dataset and eval_dataset when the "
                          "trainer is built, so that training and evaluation never run a text encoder. Needs "
                          "cache_prompt_embeddings and a prompt_cache_size at least the number of distinct prompts "
                          "(checked before the model is loaded). Every process encodes the whole set."},
    )
    offload_text_encoders: bool = field(
        default=False,
        metadata={"help": "Move the text encoders to the CPU once the cache is set up (SD3.5: CLIP-L, CLIP-G and "
                          "T5-XXL, about 11 GB in bf16 off the GPU). A prompt that is not cached brings them back to "
                          "the accelerator for that one encode, before sampling starts, and sends them away again. "
                          "Needs cache_prompt_embeddings. The pipeline's other components stay where they are: call "
                          "trainer.rollouts.prompt_cache.offload.restore() before calling trainer.pipeline(...) yourself."},
    )
    vae_decode_batch_size: int | None = field(
        default=None,
        metadata={"help": "Decode latents with the VAE this many images at a time (the images equal those of one "
                          "decode of the whole micro-batch up to float rounding); 1 gives the lowest peak memory, like "
                          "diffusers' vae.enable_slicing(). None decodes each micro-batch at once."},
    )
    vae_tiling: bool = field(
        default=False,
        metadata={"help": "Decode with the VAE's spatial tiles (diffusers' vae.enable_tiling(): overlapping tiles, "
                          "blended at the seams), whose peak memory is a tile's instead of the whole frame's. A long "
                          "720p video needs it: HunyuanVideo 1.5's VAE decodes 121 frames at 720p in about 200 GB whole "
                          "(flowgrpo plan). The pixels differ slightly from a whole decode near the seams; rewards see "
                          "the tiled decode in training and evaluation alike. Needs a VAE with enable_tiling."},
    )
    use_ema: bool = field(default=False, metadata={"help": "Keep an EMA of the trainable weights, used for "
                                                              "evaluation and saved adapters."})
    ema_decay: float = field(default=0.9, metadata={"help": "EMA decay per update (Flow-GRPO: 0.9)."})
    ema_update_interval: int = field(default=1, metadata={"help": "Optimizer steps between EMA updates."})
    ema_warmup: bool = field(default=False, metadata={
        "help": "Warm the EMA up as Flow-GRPO does: decay min((1 + step) / (10 + step), ema_decay) at optimizer step "
                "`step`, so that early evaluations do not see mostly the initial weights."})

    # ---- compiled blocks and cached rollouts ---------------------------------------------------------
    torch_compile: bool = field(
        default=False,
        metadata={"help": "Compile the transformer's repeated blocks with torch.compile (diffusers' "
                          "compile_repeated_blocks where the model declares _repeated_blocks, else each block of "
                          "_no_split_modules), with dynamic shapes, once: rollouts, evaluation and training run the "
                          "same compiled code (so the first pass's ratio stays 1), and Trainer does not compile the "
                          "whole model again. torch_compile_backend / torch_compile_mode are passed on. Logged: "
                          "timing/compile_s once, compile/graphs and compile/recompiles. Refused with FSDP, DeepSpeed "
                          "ZeRO-3 and rollout_cache (docs/benchmarks.md, 'Compiled blocks')."},
    )
    rollout_cache: str = field(
        default="none",
        metadata={"help": "Cache of transformer computations across the denoising steps of training rollouts, with "
                          "diffusers' own hooks: 'none', 'first_block' (FirstBlockCacheConfig), 'taylorseer' "
                          "(TaylorSeerCacheConfig), 'mag' (MagCacheConfig; needs mag_ratios), 'faster' "
                          "(FasterCacheConfig) or 'pab' (PyramidAttentionBroadcastConfig). On during training rollouts "
                          "only; training forwards and evaluation never use it. Only for algorithms whose loss does "
                          "not read the rollout's transition log-probs (not the Flow-GRPO family), and on the families "
                          "where the cache runs (docs/benchmarks.md, 'Cached rollouts'). Logged: "
                          "rollout/cache_skipped."},
    )
    rollout_cache_config: dict | str | None = field(
        default=None,
        metadata={"help": "Fields of the diffusers configuration of rollout_cache, e.g. {cache_interval: 4, "
                          "taylor_factors_dtype: float32} for taylorseer (JSON on the command line). The timestep "
                          "callbacks and MagCache's num_inference_steps are the rollout engine's."},
    )
    # ---- training passes -----------------------------------------------------------------------------
    train_timesteps_per_pass: str = field(
        default=1,
        metadata={"help": "Trained timesteps of a micro-batch that go through the model in one forward and one "
                          "backward, as one batch of B x K rows (Flow-GRPO and its variants, on-policy distillation: "
                          "recorded SDE steps; DiffusionNFT, DGPO, CRD: noise levels; Diffusion-DPO: noise draws; "
                          "AWM already trains all its train_timesteps in one pass, so K changes nothing there). An "
                          "integer K >= 1, or 'all' (a micro-batch in one pass). Each timestep's loss is computed "
                          "as with 1 (clipping, KL, weights, the scale of the loss; the first pass's ratio stays 1), "
                          "with ceil(T / K) passes instead of T: fewer, larger forwards and, under FSDP2, ceil(T / K) "
                          "weight gathers per micro-batch; activation memory grows with K (`flowgrpo plan` names the "
                          "largest K that fits). Default 1: one timestep at a time."},
    )

    # ---- crash safety --------------------------------------------------------------------------------
    max_consecutive_skipped_steps: int = field(
        default=5,
        metadata={"help": "An optimizer step whose loss or gradient norm is NaN/inf is skipped (weights and "
                          "optimizer state unchanged; counted in the logged skipped_steps). This many skipped steps "
                          "in a row stop the run with an error naming the last step's reward and loss statistics."},
    )
    preemption_signals: list[str] = field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        metadata={"help": "Signals that make the run finish its current optimizer step, save a checkpoint and exit "
                          "with status 0 (a second one exits at once). An empty list leaves signals alone."},
    )

    # ---- logging -------------------------------------------------------------------------------------
    log_images_steps: int = field(
        default=50,
        metadata={"help": "Send sample images with prompts and rewards to wandb / tensorboard every N optimizer "
                          "steps (0 = never)."},
    )
    num_log_images: int = field(default=8, metadata={"help": "Images (or videos) per logged panel."})
    print_full_logs: bool = field(
        default=False,
        metadata={"help": "Also print every logged dictionary (all metrics) on the terminal. By default the terminal "
                          "shows one progress bar with the reward, its std, each reward's mean, the loss and s/step, "
                          "and a short table at each evaluation (flowgrpo.trainer.console); the full dictionaries "
                          "always go to the report_to loggers and trainer_state.json."},
    )
    log_video_fps: float = field(
        default=16.0, metadata={"help": "Frame rate of the logged sample videos (Wan generates 16 fps)."},
    )
    reward_num_workers: int = field(
        default=1,
        metadata={"help": "Background threads that score decoded images while the next chunk is sampled."},
    )
    reward_offload: bool = field(
        default=False,
        metadata={"help": "Keep reward models (imagereward, hpsv2, the CLIP scorers...) on the CPU between scorings: "
                          "moved to their reward device for each scoring call and back after it, so the policy has "
                          "the accelerator's memory while it samples and trains (one host-device copy of the weights "
                          "per call). Rewards without weights are unaffected."},
    )
    cpu_threads: str = field(
        default="auto",
        metadata={"help": "Threads of each process when the transformer runs on the CPU. 'auto': this process's share "
                          "of the cores (cores / processes on the machine, or $FLOWGRPO_CPU_THREADS) minus one for the "
                          "background decode and reward threads, which get one thread each (onnxruntime too), so the "
                          "run never oversubscribes its cores; an integer fixes the main thread's torch threads; "
                          "'keep' applies no policy (torch's and onnxruntime's own settings everywhere). See flowgrpo.cpu_threads and docs/benchmarks.md."},
    )

    # ---- sequence parallelism ------------------------------------------------------------------------
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "S: processes that share each sample, each holding 1/S of its tokens inside the "
                          "transformer (Ulysses sequence parallelism through diffusers' context parallelism; "
                          "docs/distributed.md). The launch is D = processes / S data-parallel replicas of S "
                          "consecutive ranks; the S processes of a replica get the same prompts and noise, sample the "
                          "same groups, score them once and sum their gradients. For video samples too long for one "
                          "GPU (Wan, LTX-2, HunyuanVideo 1.5; also FLUX.1/Kontext, FLUX.2 and Qwen-Image). 1: off."},
    )

    # ---- rollout backend -----------------------------------------------------------------------------
    rollout_backend: str = field(
        default="local",
        metadata={"help": "Where rollouts are sampled: 'local' (in the training processes, one phase after the other) "
                          "or 'ray' (on `RolloutWorker` actors of a Ray cluster, each holding the pipeline and the "
                          "policy's weights; docs/distributed.md). Needs `pip install flowgrpo[ray]`."},
    )
    rollout_workers: int = field(
        default=1, metadata={"help": "Ray rollout actors (rollout_backend: ray). One request is one process's share "
                                     "of one generation; requests are spread over the workers."},
    )
    rollout_worker_resources: dict | str | None = field(
        default=None,
        metadata={"help": "Ray resources of each rollout worker, e.g. {num_gpus: 1, num_cpus: 4} (JSON on the command "
                          "line). Keys: num_cpus, num_gpus, memory, resources, accelerator_type. Default: one CPU, and "
                          "one GPU when the trainer runs on CUDA. On a CPU worker, num_cpus is also its torch threads "
                          "unless cpu_threads is an integer."},
    )
    max_staleness: int = field(
        default=0,
        metadata={"help": "How many optimizer steps old the weights that sampled a trained group may be "
                          "(rollout_backend: ray). 0: on-policy, generation k is sampled with the weights after "
                          "optimizer step k - 1 (equal to the local backend for the same seed). N >= 1: rollouts run "
                          "ahead of training by up to N steps (1: one-step-off, generation k + 1 is sampled while k "
                          "trains); the clipped ratio of the behaviour log-probs keeps the update safe. Never "
                          "exceeded: a group older than the bound is sampled again."},
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={"help": "Optimizer steps between two weight syncs to the rollout workers (the LoRA tensors, or the "
                          "whole transformer for full fine-tuning, plus the old-policy copy when the algorithm keeps "
                          "one). Must be <= max_staleness + 1."},
    )
    weight_sync: str = field(
        default="object_store",
        metadata={"help": "How the weights reach the rollout workers (rollout_backend: ray). 'object_store': process 0 "
                          "puts them in Ray's object store once and every worker reads them (works anywhere Ray does; "
                          "a host round trip per sync). 'collective': a torch.distributed group of process 0 and the "
                          "workers (gloo on CPUs, NCCL when all are on CUDA GPUs, one GPU each), the state broadcast in "
                          "buckets of weight_sync_bucket_mb; formed again when Ray restarts a worker. Both check the "
                          "version and the digest of what each worker holds (docs/distributed.md)."},
    )
    weight_sync_bucket_mb: float = field(
        default=256.0,
        metadata={"help": "weight_sync: collective: the largest bucket of one broadcast, in MiB (a larger tensor "
                          "travels alone)."},
    )
    reward_backend: str = field(
        default="local",
        metadata={"help": "Where rewards are scored: 'local' (the training processes' reward threads, each "
                          "micro-batch as it arrives) or 'ray' (reward_workers `RewardWorker` actors, e.g. reward "
                          "models on their own GPUs; rewards must then be registry names or importable paths)."},
    )
    reward_workers: int = field(default=1, metadata={"help": "Ray reward actors (reward_backend: ray)."})
    reward_worker_resources: dict | str | None = field(
        default=None,
        metadata={"help": "Ray resources of each reward worker (same keys as rollout_worker_resources). Default: one "
                          "CPU."},
    )
    ray_address: str | None = field(
        default=None,
        metadata={"help": "The Ray cluster to join (e.g. 10.0.0.1:6379). Default: the RAY_ADDRESS environment "
                          "variable, else a local cluster started by the trainer with token authentication (a fresh "
                          "token per run, in a file only its owner can read), no dashboard and no Jobs API. Joining a "
                          "cluster without token authentication warns."},
    )
    ray_start_timeout_s: float = field(
        default=120.0,
        metadata={"help": "The longest wait for the local Ray cluster the trainer starts (each node's `ray start` and "
                          "the connection); past it the run stops with an error naming the node and the end of its "
                          "log, and nothing is left running."},
    )
    rollout_timeout_s: float = field(
        default=1800.0,
        metadata={"help": "The longest wait for a rollout worker: one process's share of a generation, a weight "
                          "sync's answer, a restarted worker coming back. Past it the run stops with a checkpoint of "
                          "the last completed step and an error naming the worker (resume with "
                          "--resume_from_checkpoint last)."},
    )
    rollout_startup_timeout_s: float = field(
        default=3600.0,
        metadata={"help": "The longest wait for the rollout and reward workers to start (each loads the pipeline)."},
    )
    max_worker_restarts: int = field(
        default=3,
        metadata={"help": "Restarts Ray grants each rollout worker that dies (max_restarts). A restarted worker "
                          "reloads the current weights and its lost requests are sampled again with their own seeds; "
                          "counted in rollout/worker_restarts."},
    )
    truncated_importance_cap: float | None = field(
        default=None,
        metadata={"help": "Flow-GRPO family with rollout_backend: ray. Unset: the clipped ratio is taken against the "
                          "worker's behaviour log-probs. C >= 1: the trainer recomputes each recorded transition's "
                          "log-prob with its weights when the generation arrives (the proximal policy of the clipped "
                          "ratio) and weights each sample's advantage by min(exp(sum_j logp_prox - logp_behaviour), "
                          "C). Cost: one no-grad forward per recorded step and sample, about a third of the training "
                          "step's forward and backward (docs/distributed.md)."},
    )

    # ---- TrainingArguments defaults that differ for this trainer -------------------------------------
    learning_rate: float = field(default=3e-4, metadata={"help": "AdamW learning rate (Flow-GRPO LoRA: 3e-4)."})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay (Flow-GRPO: 1e-4)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (Flow-GRPO: 1.0)."})
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: the trainer needs the prompt column and reward columns."},
    )
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Images per micro-batch per process, for sampling and for training."},
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Images per evaluation batch per process."})
    ddp_find_unused_parameters: bool | None = field(
        default=None,
        metadata={"help": "DDP's find_unused_parameters. None (default): the model family decides: False where every "
                          "trainable weight (LoRA or the whole transformer) takes part in every training forward (SD3, "
                          "FLUX, Kontext, Wan 2.1), which spares DDP an extra graph traversal per step; True for "
                          "Qwen-Image (its last text stream is discarded) and Wan 2.2's two experts (a step runs one)."},
    )

    def __post_init__(self):
        super().__post_init__()
        self.height = self.height or self.resolution
        self.width = self.width or self.resolution
        self._apply_rollouts_at_eval_guidance()
        if self.eval_guidance_scale is None and self.guidance_scale is not None:
            self.eval_guidance_scale = self.guidance_scale
        if self.eval_guidance_scales is not None:
            scales = [self.eval_guidance_scales] if isinstance(self.eval_guidance_scales, (int, float)) \
                else list(self.eval_guidance_scales)
            if not scales or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in scales):
                raise ValueError(f"eval_guidance_scales={self.eval_guidance_scales!r} must be a list of guidance "
                                 "scales >= 0, e.g. [1.0, 3.0].")
            self.eval_guidance_scales = [float(v) for v in scales]
        if isinstance(self.reward_kwargs, str):
            import json

            self.reward_kwargs = json.loads(self.reward_kwargs)
        self._check_crash_safety()
        self._check_choices()
        self._check_algorithm()
        from ..cpu_threads import parse_cpu_threads

        self.cpu_threads = str(parse_cpu_threads(self.cpu_threads))
        self._check_sequence_parallel()
        self._derive_generation_batch()
        self._check_memory_options()
        self._check_speed_options()
        self._check_rollout_backend()
        if self.remove_unused_columns:
            raise ValueError(f"remove_unused_columns=True would drop the prompt column; {self._trainer_name} needs "
                             "remove_unused_columns=False.")
        if self.ema_decay < 0 or self.ema_decay >= 1:
            raise ValueError(f"ema_decay={self.ema_decay} must be in [0, 1).")
        from .timestep_passes import parse_timesteps_per_pass

        self.train_timesteps_per_pass = parse_timesteps_per_pass(self.train_timesteps_per_pass)
        self._check_health_settings()

    #: the trainer this configuration is for (in error messages)
    _trainer_name = "the trainer"
    def _apply_rollouts_at_eval_guidance(self) -> None:
        """``rollouts_at_eval_guidance``: the rollouts' scale (``guidance_scale``) becomes ``eval_guidance_scale``,
        where the algorithm allows it."""
        if not self.rollouts_at_eval_guidance:
            return
        from .registry import spec_of

        refusal = spec_of(self).eval_guidance_rollouts_refusal  # the algorithm's spec says whether it may
        if refusal:
            raise ValueError(f"rollouts_at_eval_guidance=True is refused by {self._trainer_name}: {refusal}. To roll "
                             "out and train at the evaluation's guidance, set guidance_scale to eval_guidance_scale "
                             "instead.")
        if self.eval_guidance_scale is None:
            raise ValueError("rollouts_at_eval_guidance=True samples the rollouts at eval_guidance_scale, which is not "
                             "given; set eval_guidance_scale (e.g. 3.0, the scale the evaluation uses).")
        self.guidance_scale = float(self.eval_guidance_scale)

    #: why the algorithm's rollouts sample without classifier-free guidance, when they do by design (an unset
    #: guidance_scale is then the family's no-guidance value, not the model card's); None: the model's guidance
    _cfg_free_rollouts: ClassVar[str | None] = None
    #: the smallest group the algorithm accepts (group advantages need 2; a reward-gradient trainer has no groups)
    _min_group_size: ClassVar[int] = 2

    def _check_generation_settings(self) -> None:
        """The checks that use the generation settings, run again once the trainer has resolved them from the model
        (``flowgrpo.models.defaults.apply_generation_settings``)."""
        self._check_choices()
        self._check_algorithm()
        self._check_health_settings()

    def _check_health_settings(self) -> None:
        """Gold rewards, best model, alarms and guards (health/arguments.py). Their bound of ``base_model_tail_steps``
        by ``num_inference_steps`` waits for the step count when it is the model's own (checked once resolved)."""
        steps = self.num_inference_steps
        if steps is None:
            self.num_inference_steps = math.inf
        try:
            check_health_arguments(self)
        finally:
            self.num_inference_steps = steps

    def _check_algorithm(self) -> None:
        """The algorithm's own settings: checked by each trainer's config (after the shared ones)."""

    # ---------------------------------------------------------------------------------------------------
    def _check_choices(self) -> None:
        check_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("reward_aggregation", self.reward_aggregation, REWARD_AGGREGATIONS)
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.num_generations < self._min_group_size:
            raise ValueError(f"num_generations={self.num_generations}: a group needs at least {self._min_group_size} "
                             f"images to compute advantages; set num_generations >= {self._min_group_size}.")
        if self.eval_images_per_prompt < 1:
            raise ValueError(f"eval_images_per_prompt={self.eval_images_per_prompt} must be >= 1.")
        if self.num_frames is not None and (isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int)
                                            or self.num_frames < 1):
            raise ValueError(f"num_frames={self.num_frames!r} must be an integer >= 1 (1 for image families; Wan: "
                             "4k + 1), or unset for the model's own.")
        if self.log_video_fps <= 0:
            raise ValueError(f"log_video_fps={self.log_video_fps} must be > 0.")
        if self.num_inference_steps is not None and self.num_inference_steps < 2:
            raise ValueError(f"num_inference_steps={self.num_inference_steps} must be >= 2.")
        if self.eval_num_inference_steps is not None and self.eval_num_inference_steps < 1:
            raise ValueError(f"eval_num_inference_steps={self.eval_num_inference_steps} must be >= 1.")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={self.max_sequence_length} must be >= 1, or unset for the model's "
                             "own.")
        for name in ("guidance_scale", "eval_guidance_scale"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value} must be >= 0 (1 = no guidance for most families), or unset for the "
                                 "model's own.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0.")
        if self.adv_clip_max <= 0:
            raise ValueError(f"adv_clip_max={self.adv_clip_max} must be > 0.")
        for name in ("height", "width"):
            if getattr(self, name) is not None and getattr(self, name) % 16:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 16 (VAE downsampling x patch "
                                 "size); round it, e.g. to 512.")

    def _check_crash_safety(self) -> None:
        from ..rewards.failures import normalize_on_failure
        from .run_state.preemption import resolve_signal

        policy = "raise" if self.reward_on_failure is None else self.reward_on_failure
        if isinstance(policy, str) and policy.strip().startswith("{"):
            import json

            policy = json.loads(policy)
        if isinstance(policy, dict):
            self.reward_on_failure = {str(k): normalize_on_failure(v, f"reward_on_failure[{k!r}]")
                                      for k, v in policy.items()}
        else:
            self.reward_on_failure = normalize_on_failure(policy, "reward_on_failure")
        if self.max_consecutive_skipped_steps < 1:
            raise ValueError(f"max_consecutive_skipped_steps={self.max_consecutive_skipped_steps} must be >= 1 (the "
                             "number of skipped non-finite steps in a row that stops the run).")
        self.preemption_signals = [str(s) for s in (self.preemption_signals or [])]
        for name in self.preemption_signals:
            resolve_signal(name)

    def _check_sequence_parallel(self) -> None:
        """``sequence_parallel_size``: an integer >= 1 that divides the launch, with an algorithm and a backend that
        have been run with it."""
        size = self.sequence_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"sequence_parallel_size={size!r} must be an integer >= 1 (1: every process holds whole "
                             "samples).")
        if size == 1:
            return
        from .registry import spec_of

        if not spec_of(self).sequence_parallel:  # the algorithm's spec: tested with S > 1 or not
            raise ValueError(f"sequence_parallel_size={size} with {self._trainer_name}: this algorithm has not been "
                             "tested with sequence parallelism (Flow-GRPO and DiffusionNFT have); use "
                             "sequence_parallel_size 1.")
        if self.rollout_backend != "local":
            raise ValueError(f"sequence_parallel_size={size} with rollout_backend={self.rollout_backend!r}: each "
                             f"rollout worker would have to span {size} GPUs (one sequence-parallel group), which the "
                             "Ray backend does not do; use rollout_backend: local.")
        if self.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            raise ValueError(f"sequence_parallel_size={size} with DeepSpeed: sequence parallelism runs with DDP and "
                             "FSDP2 (accelerate_configs/fsdp8_video.yaml); launch with one of those.")
        if self.world_size > 1:  # one process is how recipes are parsed for planning and --help; trainers check it
            self.check_sequence_parallel_launch(self.world_size)

    def check_sequence_parallel_launch(self, processes: int) -> None:
        """Refuse a launch of ``processes`` that ``sequence_parallel_size`` does not divide (the trainer calls it before
        loading anything; the planner with the GPUs it plans for)."""
        size = self.sequence_parallel_size
        if processes % size:
            raise ValueError(f"sequence_parallel_size={size} does not divide the {processes} processes of this "
                             f"launch; launch a multiple of {size} processes (data-parallel replicas x "
                             "sequence_parallel_size) or change it.")

    @property
    def data_parallel_size(self) -> int:
        """D: the data-parallel replicas of the launch, ``processes / sequence_parallel_size`` (at least 1)."""
        return max(1, self.world_size // self.sequence_parallel_size)

    def _derive_generation_batch(self) -> None:
        num_processes = self.data_parallel_size  # the processes of a sequence-parallel group share their samples
        processes = "processes" if self.sequence_parallel_size == 1 else \
            f"data-parallel replicas ({self.world_size} processes / sequence_parallel_size {self.sequence_parallel_size})"
        global_micro = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("generation_batch_size and steps_per_generation are mutually exclusive; set one.")
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = global_micro * self.steps_per_generation
        else:
            if self.generation_batch_size % global_micro:
                raise ValueError(
                    f"generation_batch_size={self.generation_batch_size} must be divisible by "
                    f"per_device_train_batch_size x {processes} = {self.per_device_train_batch_size} x "
                    f"{num_processes} = {global_micro}."
                )
            self.steps_per_generation = self.generation_batch_size // global_micro
        if self.generation_batch_size % self.num_generations:
            prompts = max(1, self.generation_batch_size // self.num_generations)
            raise ValueError(
                f"The generation batch ({self.generation_batch_size} images = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {num_processes} {processes} x steps_per_generation "
                f"{self.steps_per_generation}) is not divisible by num_generations={self.num_generations}. Make it a "
                f"multiple, e.g. per_device_train_batch_size / steps_per_generation giving "
                f"{prompts * self.num_generations} images, or change num_generations."
            )

    def _check_memory_options(self) -> None:
        if self.prompt_cache_size < 1:
            raise ValueError(f"prompt_cache_size={self.prompt_cache_size} must be >= 1 (the number of prompts the "
                             "embedding cache holds).")
        for name in ("offload_text_encoders", "precompute_prompt_embeddings"):
            if getattr(self, name) and not self.cache_prompt_embeddings:
                raise ValueError(f"{name}=True needs cache_prompt_embeddings=True (the embeddings must be kept for the "
                                 "encoders to be skipped); set cache_prompt_embeddings: true.")
        if self.vae_decode_batch_size is not None and self.vae_decode_batch_size < 1:
            raise ValueError(f"vae_decode_batch_size={self.vae_decode_batch_size} must be >= 1 images per VAE decode, "
                             "or None to decode each micro-batch at once.")

    def _check_speed_options(self) -> None:
        """``rollout_cache`` and its configuration's form (the fields against diffusers' configuration, the algorithm
        and the family are checked by the trainer before loading: `speed_settings.check_speed_settings`)."""
        from .speed_settings import ROLLOUT_CACHES, parse_rollout_cache_config

        check_choice("rollout_cache", self.rollout_cache, ROLLOUT_CACHES)
        self.rollout_cache_config = parse_rollout_cache_config(self.rollout_cache_config)
        if self.rollout_cache == "none" and self.rollout_cache_config:
            raise ValueError(f"rollout_cache_config={self.rollout_cache_config} is given but rollout_cache is 'none'; "
                             "set rollout_cache (e.g. taylorseer) or leave rollout_cache_config out.")

    def _check_rollout_backend(self) -> None:
        from .rollout_settings import check_rollout_backend_settings

        check_rollout_backend_settings(self)

    @property
    def evaluation_guidance_scales(self) -> list[float]:
        """The guidance scales of an evaluation: ``eval_guidance_scale`` first (once given or resolved), then the
        other ``eval_guidance_scales``."""
        first = [] if self.eval_guidance_scale is None else [float(self.eval_guidance_scale)]
        return list(dict.fromkeys([*first, *(self.eval_guidance_scales or [])]))

    @property
    def image_size(self) -> tuple[int, int] | tuple[None, None]:
        """``(height, width)``; ``(None, None)`` until the model's own size is resolved (by the trainer)."""
        if self.height is None or self.width is None:
            return None, None
        return int(self.height), int(self.width)
