"""FlowGRPOConfig: every knob of Flow-GRPO training, as a `transformers.TrainingArguments` subclass.

Defaults follow the published Flow-GRPO recipes for Stable Diffusion 3.5 Medium where they exist (LoRA
r=32/alpha=64, lr 3e-4, 10 sampling steps, 40 evaluation steps, CFG 4.5, noise level 0.7, KL weight 0.04,
clip range 1e-4, advantage clip 5, 512 px); each field's help says where its default comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

SDE_TYPES = ("sde", "cps")
SCALE_REWARDS = ("batch", "group", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("4bit", "8bit")


@dataclass
class FlowGRPOConfig(TrainingArguments):
    r"""Configuration for [`FlowGRPOTrainer`].

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
                          "num_processes x steps_per_generation. Must be divisible by num_generations. Mutually "
                          "exclusive with steps_per_generation."},
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-batches trained per process on each generation batch. Defaults to "
                          "gradient_accumulation_steps, i.e. one generation batch per optimizer step."},
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Passes (PPO epochs) over each generation batch. 1 is strictly on-policy, as in "
                          "Flow-GRPO; >1 reuses samples and makes the clipped ratio matter."},
    )

    # ---- sampling ------------------------------------------------------------------------------------
    resolution: int = field(
        default=512,
        metadata={"help": "Square image side in pixels (SD3.5-M Flow-GRPO recipes: 512). Overridden by height/width."},
    )
    height: int | None = field(default=None, metadata={"help": "Image height; defaults to resolution."})
    width: int | None = field(default=None, metadata={"help": "Image width; defaults to resolution."})
    num_frames: int = field(
        default=1,
        metadata={"help": "Frames per sample: 1 for image families (SD3, FLUX, Qwen-Image, the editing models); video "
                          "families need their own counts (Wan: 4k + 1, e.g. 81 as released, 33 or 5 for small runs). "
                          "The family's rule is checked as soon as the pipeline's class is known, before loading it."},
    )
    num_inference_steps: int = field(
        default=10,
        metadata={"help": "Sampling steps of training rollouts (Flow-GRPO trains with 10 and evaluates with 40)."},
    )
    eval_num_inference_steps: int = field(
        default=40, metadata={"help": "ODE sampling steps for evaluation (Flow-GRPO: 40)."},
    )
    eval_images_per_prompt: int = field(
        default=1,
        metadata={"help": "Images per eval prompt, each from its own fixed seed. More images average out the "
                          "sampling noise of the eval metrics (a small eval set with one image per prompt moves by "
                          "several points between seeds)."},
    )
    guidance_scale: float = field(
        default=4.5,
        metadata={"help": "Classifier-free guidance scale of rollouts (SD3.5-M recipes: 4.5). 1.0 disables CFG: "
                          "one transformer pass per step (the CFG-free 'Fast' recipes). Training recomputes the "
                          "velocity with the same scale and negative embeddings."},
    )
    eval_guidance_scale: float | None = field(
        default=None, metadata={"help": "Guidance scale for evaluation; defaults to guidance_scale."},
    )
    negative_prompt: str = field(
        default="", metadata={"help": "Negative prompt for classifier-free guidance (SD3 recipes use the empty prompt)."},
    )
    max_sequence_length: int = field(
        default=256, metadata={"help": "T5 token length of prompt embeddings (SD3 pipelines default to 256)."},
    )
    noise_level: float = field(
        default=0.7,
        metadata={"help": "SDE noise level a (Flow-GRPO: 0.7). For 'sde' the step std is a*sqrt(sigma/(1-sigma))*"
                          "sqrt(-dt); for 'cps' it is sigma' * sin(a*pi/2). 0 gives deterministic ODE sampling, "
                          "which cannot be trained."},
    )
    sde_type: str = field(
        default="sde",
        metadata={"help": "Stochastic sampler: 'sde' (Flow-GRPO's marginal-preserving reverse SDE) or 'cps' "
                          "(coefficients-preserving sampling, suited to few steps)."},
    )
    sde_window_size: int = field(
        default=0,
        metadata={"help": "Flow-GRPO-Fast / MixGRPO windows: number of consecutive SDE steps per rollout; ODE "
                          "elsewhere, and only the window's steps are stored and trained. 0 = SDE on every step "
                          "but the last (plain Flow-GRPO)."},
    )
    sde_window_range: list[int] | None = field(
        default=None,
        metadata={"help": "Two integers [lo, hi): the window start is drawn uniformly from this range for each "
                          "rollout; windows end before the last step. Defaults to [0, min(num_inference_steps // 2, "
                          "num_inference_steps - sde_window_size)]."},
    )

    # ---- objective -----------------------------------------------------------------------------------
    beta: float = field(
        default=0.04,
        metadata={"help": "KL weight to the reference policy (LoRA disabled, or a frozen copy for full "
                          "fine-tuning). Flow-GRPO SD3.5-M recipes: 0.04. 0 skips the reference pass."},
    )
    epsilon: float = field(
        default=1e-4,
        metadata={"help": "PPO clip range of the likelihood ratio. Flow-GRPO: 1e-4 (tuned for mean-reduced "
                          "log-probs)."},
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
    on_policy_tolerance: float = field(
        default=1e-3,
        metadata={"help": "On the first pass over a fresh batch the ratio must be exactly 1; warn when |ratio - 1| "
                          "exceeds this (dtype or batch-composition mismatch, dropout, non-determinism)."},
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
    use_ema: bool = field(default=False, metadata={"help": "Keep an EMA of the trainable weights, used for "
                                                              "evaluation and saved adapters."})
    ema_decay: float = field(default=0.9, metadata={"help": "EMA decay per update (Flow-GRPO: 0.9)."})
    ema_update_interval: int = field(default=1, metadata={"help": "Optimizer steps between EMA updates."})

    # ---- logging -------------------------------------------------------------------------------------
    log_images_steps: int = field(
        default=50,
        metadata={"help": "Send sample images with prompts and rewards to wandb / tensorboard every N optimizer "
                          "steps (0 = never)."},
    )
    num_log_images: int = field(default=8, metadata={"help": "Images (or videos) per logged panel."})
    log_video_fps: float = field(
        default=16.0, metadata={"help": "Frame rate of the logged sample videos (Wan generates 16 fps)."},
    )
    reward_num_workers: int = field(
        default=1,
        metadata={"help": "Background threads that score decoded images while the next chunk is sampled."},
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

    def __post_init__(self):
        super().__post_init__()
        self.height = self.height or self.resolution
        self.width = self.width or self.resolution
        if self.eval_guidance_scale is None:
            self.eval_guidance_scale = self.guidance_scale
        if isinstance(self.reward_kwargs, str):
            import json

            self.reward_kwargs = json.loads(self.reward_kwargs)
        self._check_choices()
        self._derive_generation_batch()
        self._check_window()
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns=True would drop the prompt column; FlowGRPOTrainer needs "
                             "remove_unused_columns=False.")
        if self.ema_decay < 0 or self.ema_decay >= 1:
            raise ValueError(f"ema_decay={self.ema_decay} must be in [0, 1).")

    # ---------------------------------------------------------------------------------------------------
    def _check_choices(self) -> None:
        def check(name: str, value, choices) -> None:
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}.")

        check("sde_type", self.sde_type, SDE_TYPES)
        check("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check("dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            check("quantization", self.quantization, QUANTIZATIONS)
        if self.num_generations < 2:
            raise ValueError(f"num_generations={self.num_generations}: a group needs at least 2 images to compute "
                             "advantages; set num_generations >= 2.")
        if self.eval_images_per_prompt < 1:
            raise ValueError(f"eval_images_per_prompt={self.eval_images_per_prompt} must be >= 1.")
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level} must be >= 0.")
        if isinstance(self.num_frames, bool) or not isinstance(self.num_frames, int) or self.num_frames < 1:
            raise ValueError(f"num_frames={self.num_frames!r} must be an integer >= 1 (1 for image families; Wan: "
                             "4k + 1).")
        if self.log_video_fps <= 0:
            raise ValueError(f"log_video_fps={self.log_video_fps} must be > 0.")
        if self.num_inference_steps < 2:
            raise ValueError(f"num_inference_steps={self.num_inference_steps} must be >= 2.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.epsilon <= 0:
            raise ValueError(f"epsilon={self.epsilon} must be > 0.")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0.")
        if self.adv_clip_max <= 0:
            raise ValueError(f"adv_clip_max={self.adv_clip_max} must be > 0.")
        for name in ("height", "width"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 16 (VAE downsampling x patch "
                                 "size); round it, e.g. to 512.")

    def _derive_generation_batch(self) -> None:
        num_processes = self.world_size
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
                    f"per_device_train_batch_size x num_processes = {self.per_device_train_batch_size} x "
                    f"{num_processes} = {global_micro}."
                )
            self.steps_per_generation = self.generation_batch_size // global_micro
        if self.generation_batch_size % self.num_generations:
            prompts = max(1, self.generation_batch_size // self.num_generations)
            raise ValueError(
                f"The generation batch ({self.generation_batch_size} images = per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x {num_processes} processes x steps_per_generation "
                f"{self.steps_per_generation}) is not divisible by num_generations={self.num_generations}. Make it a "
                f"multiple, e.g. per_device_train_batch_size / steps_per_generation giving "
                f"{prompts * self.num_generations} images, or change num_generations."
            )

    def _check_window(self) -> None:
        steps = self.num_inference_steps
        k = self.sde_window_size
        if k < 0:
            raise ValueError(f"sde_window_size={k} must be >= 0 (0 = SDE on every step but the last).")
        if k == 0:
            return
        if k > steps - 1:
            raise ValueError(f"sde_window_size={k} must be at most num_inference_steps - 1 = {steps - 1} (the last "
                             "step is nearly deterministic and never trained); lower the window or raise the step "
                             "count.")
        if self.sde_window_range is None:
            self.sde_window_range = [0, max(1, min(steps // 2, steps - k))]
        if len(self.sde_window_range) != 2:
            raise ValueError(f"sde_window_range={self.sde_window_range} must be two integers [lo, hi).")
        lo, hi = (int(v) for v in self.sde_window_range)
        if lo < 0 or hi <= lo or hi + k > steps:
            raise ValueError(
                f"sde_window_range={[lo, hi]} with sde_window_size={k} does not fit num_inference_steps={steps}: "
                f"the latest window [{hi - 1}, {hi - 1 + k}) must end before the last step {steps - 1}. Use "
                f"0 <= lo < hi <= {steps - k}."
            )
        self.sde_window_range = [lo, hi]

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.height), int(self.width)
