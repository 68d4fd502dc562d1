"""From a parsed recipe to a plan: per-GPU memory by term and phase, step FLOPs and time, and suggestions.

Memory per GPU, in bytes (``Psi`` = parameters; ``N`` = world size; ``b`` = bytes of the model dtype):

=====================  ==============================================================================================
term                   how it is counted
=====================  ==============================================================================================
weights                frozen transformer weights (``b``, or NF4 / int8 for ``quantization``: 0.5 + 1/16 and 1 + 1/64
                       bytes a linear weight), trained weights (LoRA: float32, as the trainer casts them; full FT:
                       ``b``, float32 under FSDP2 with mixed precision as accelerate upcasts them), text encoders unless
                       ``offload_text_encoders``, the VAE. Sharded by FSDP2 and ZeRO-3 (/N); ZeRO-3 adds DeepSpeed's
                       4 x largest-layer gather buffer, FSDP2 the gathered block (two with prefetch; the whole model
                       with ``fsdp_reshard_after_forward: false``).
gradients              trained parameters x their bytes; DDP keeps a second copy in its buckets; /N under FSDP2;
                       ZeRO: DeepSpeed's 16-bit + 32-bit gradient partitions (2 + 4 bytes /N) plus, for ZeRO-2, the
                       16-bit gradients before reduction.
optimizer_states       AdamW: 2 states in the parameter's dtype (torch keeps them so), 8-bit AdamW (``adamw_bnb_8bit``):
                       2 bytes + block scales; ZeRO: float32 master + 2 float32 states (12 bytes) /N.
activations            measured: the transient peak of one trained pass's forward + backward on fake tensors (K =
                       ``train_timesteps_per_pass`` trained timesteps stacked into one batch; torch's gradient
                       checkpointing run as the trainer runs it), the parameters' gradients set aside as they
                       appear (they are the gradients term, sharded as the configuration shards them).
                       Rollout: one sampling step's peak; decode: one slice's.
copies                 EMA (float32 copy of the trained parameters), DiffusionNFT's old policy, DGPO's EMA reference,
                       CRD's old and sampling copies (LoRA: one more adapter each; full FT: a frozen copy each), the KL
                       reference of full fine-tuning (a frozen copy, not sharded: it lives outside FSDP), on-policy
                       distillation's teachers (a LoRA: another adapter of the trained rank; another checkpoint or a
                       merged copy: a transformer in the model dtype), and the stored rollout trajectories of a
                       generation batch (x_j, x_{j+1}, and the transition means for GRPO-Guard, Flow-DPPO and
                       BranchGRPO).
reward_model           the GPU reward models' weights (REWARD_MODEL_PARAMS); rewards scored on the CPU or a server: 0.
overhead               CUDA context 0.75 GB, NCCL buffers 0.5 GB when N > 1, and 10% of the dynamic terms
                       (activations and decode) for the caching allocator's fragmentation.
=====================  ==============================================================================================

Phases: ``rollout`` = persistent terms + trajectories + the larger of a sampling step and a decode slice (gradients
are freed by ``zero_grad``); ``training`` = persistent terms + gradients + activations + trajectories.

FLOPs: the rollout's transformer passes per sample (BranchGRPO: a tree's rows summed over the steps, divided by its
leaves, since the samples of a tree share their prefixes) and the trained transitions per sample (a tree's edges per
leaf), each with the forwards without gradient the algorithm's spec names (the reference, a teacher, the old policy);
whatever K, as many rows are trained. Under FSDP2 / ZeRO-3 each trained pass gathers the weights for its forward and
again for its backward: ceil(T / K) passes per micro-batch. `largest_timesteps_per_pass` finds the largest K whose
plan fits the GPU.
What the step is comes from the algorithm's spec (`AlgorithmFacts.step` and ``copies``), never from its name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .accelerate_config import Parallelism
from .gpus import GPU
from .model_specs import ModelSpec, load_model_spec
from .step import StepMeasure, StepSettings, measure_full_depth

GB = 1e9
#: GPU-resident reward models: parameters and bytes a parameter (the registry's models at their load dtype).
REWARD_MODEL_PARAMS: dict[str, tuple[float, int]] = {
    "pickscore": (986e6, 2),     # yuvalkirstain/PickScore_v1: CLIP ViT-H/14, fp16
    "clipscore": (428e6, 2),     # openai/clip-vit-large-patch14
    "aesthetic": (428e6 + 0.8e6, 2),  # CLIP ViT-L/14 + the LAION aesthetic MLP
    "editreward": (7.75e9, 2),   # TIGER-Lab/EditReward-Qwen2.5-VL-7B: Qwen2.5-VL-7B without its LM head, bf16
    "clap": (193e6, 4),          # laion/larger_clap_general: HTSAT + RoBERTa, fp32
    "videoalign": (2.21e9, 2),   # KlingTeam/VideoReward: Qwen2-VL-2B (LoRA merged) + a linear head, bf16
    "geneval2": (8.77e9, 2),     # Qwen/Qwen3-VL-8B-Instruct, bf16
    "hpsv2": (986e6, 4),         # HPS v2.1: open_clip ViT-H-14, float32 (the reward's default)
    "imagereward": (446e6, 4),   # ImageReward v1.0: BLIP ViT-L/16 + BERT-base with cross-attention + MLP, float32
}
CUDA_CONTEXT_GB = 0.75
NCCL_BUFFERS_GB = 0.5
FRAGMENTATION = 0.10


@dataclass
class PlanInputs:
    """Everything a plan depends on."""

    spec: ModelSpec
    settings: StepSettings
    parallel: Parallelism
    gpu: GPU
    gradient_accumulation_steps: int
    optimizer: str
    quantization: str | None
    use_ema: bool
    offload_text_encoders: bool
    rewards: tuple[str, ...]
    trained_steps: int
    #: S: the processes that split each sample's tokens (``sequence_parallel_size``; 1: off)
    sequence_parallel_size: int = 1


@dataclass
class Plan:
    inputs: PlanInputs
    breakdown: dict[str, float]
    phases: dict[str, float]
    step_flops: float
    step_time_s: float
    comm_time_s: float
    method: str
    notes: list[str] = field(default_factory=list)
    deepspeed_check: dict[str, float] | None = None
    #: the measured step the plan was composed from (the Ray backend's worker plan reuses it)
    measure: StepMeasure | None = None
    #: bytes each GPU sends per optimizer step in sequence parallelism's all-to-alls (in ``comm_time_s``)
    sequence_parallel_bytes: float = 0.0

    @property
    def peak_gb(self) -> float:
        return max(self.phases.values())


def settings_from_args(training_args: Any, model_args: Any, trainer: str) -> StepSettings:
    """The step the planner measures, from the recipe's arguments and what the algorithm's spec plans
    (`AlgorithmFacts.step`: the trained forward's input, the trained timesteps, the forwards without gradient, the
    copies of the policy)."""
    from ..trainer.registry import TRAINERS

    args = training_args
    facts = TRAINERS[trainer].facts(args, use_lora=bool(model_args.use_peft))
    planned = facts.step
    height, width = args.image_size
    steps = int(args.num_inference_steps)
    teachers = sum(c.count for c in facts.copies if c.name == "teacher")
    teacher_kind = next((("lora" if c.kind == "adapter" else "model") for c in facts.copies if c.name == "teacher"),
                        "")
    copies = sum(c.count for c in facts.copies if c.name != "teacher")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        str(args.dtype), torch.bfloat16)
    micro = int(args.per_device_train_batch_size)
    from ..trainer.timestep_passes import resolved_timesteps_per_pass

    per_pass = resolved_timesteps_per_pass(args.train_timesteps_per_pass, planned.trained_timesteps)
    return StepSettings(
        height=int(height), width=int(width), num_frames=int(getattr(args, "num_frames", 1) or 1), micro_batch=micro,
        num_inference_steps=steps, trained_steps=planned.trained_timesteps, guidance_scale=float(args.guidance_scale),
        text_tokens=int(args.max_sequence_length), dtype=dtype, use_lora=bool(model_args.use_peft),
        lora_r=int(model_args.lora_r), lora_alpha=int(model_args.lora_alpha),
        lora_targets=tuple(model_args.lora_target_modules or ()),
        checkpointing=bool(args.activation_checkpointing or args.gradient_checkpointing),
        beta=float(args.beta), trained_input=planned.trained_input, frozen_forwards=planned.frozen_forwards,
        loss=planned.loss, unsharded_reference=planned.unsharded_reference, policy_copies=copies,
        samples_with_copy=facts.workers.sampled_by != "policy",
        noise_level=planned.noise_level, sde_type=planned.sde_type,
        decode_batch=min(micro, int(getattr(args, "vae_decode_batch_size", None) or micro)),
        rollout_passes=planned.rollout_passes, trained_passes=planned.trained_per_sample,
        trained_batch=planned.trained_batch, stored_per_step=planned.stored_per_step, teachers=teachers,
        teacher_kind=teacher_kind, split_tokens=int(args.sequence_parallel_size or 1) > 1,
        vae_tiling=bool(args.vae_tiling), backprop_steps=planned.backprop_steps,
        checkpointed_steps=planned.checkpointed_steps, timesteps_per_pass=per_pass)


def _opt_bytes_per_param(optimizer: str, param_bytes: int) -> float:
    if "8bit" in optimizer:
        return 2.0 + 2 * 4 / 2048  # two uint8 states + a float32 scale per 2048-element block each
    if optimizer.startswith("sgd"):
        return 0.0
    return 2.0 * param_bytes


def compose(inputs: PlanInputs, measure: StepMeasure, smallest: StepMeasure, blocks: int) -> Plan:
    """Per-GPU memory terms, phases, FLOPs and time from a measured step."""
    spec, s, par = inputs.spec, inputs.settings, inputs.parallel
    n = par.world_size
    b = s.dtype.itemsize
    experts = spec.experts
    params = {k: v * experts for k, v in measure.params.items()}
    trainable, frozen = params["trainable"], params["frozen"]
    block_max = smallest.params.get("block_max", 0.0) if blocks > 1 else measure.params.get("block_max", 0.0)
    linear = params["linear"]
    notes: list[str] = []

    # ---- weights ------------------------------------------------------------------------------------------------
    frozen_bytes = frozen_weight_bytes(frozen, linear, b, inputs.quantization)
    if s.use_lora:
        train_bytes = 4
    elif par.kind == "fsdp" and par.mixed_precision != "no":
        train_bytes = 4
        notes.append("FSDP2 with mixed precision: accelerate upcasts the trained parameters to float32.")
    else:
        train_bytes = b
    other_weights = other_weight_bytes(spec, b, inputs.offload_text_encoders)
    opt_per_param = _opt_bytes_per_param(inputs.optimizer, train_bytes)

    gather = 0.0
    if par.kind in ("single", "ddp"):
        weights = frozen_bytes + trainable * train_bytes
        grads = trainable * train_bytes * (2 if par.kind == "ddp" else 1)
        opt = trainable * opt_per_param
    elif par.kind == "fsdp":
        weights = (frozen_bytes + trainable * train_bytes) / n
        gather = (params["total"] * b) if not par.reshard_after_forward else 2 * block_max * b
        weights += gather
        grads = trainable * train_bytes / n + (block_max * 4 if not s.use_lora else 0.0)
        opt = trainable * opt_per_param / n
        if par.offload_params:
            weights, grads, opt = gather, 0.0, 0.0
            notes.append("fsdp_offload_params: parameters, gradients and optimizer states live in CPU memory.")
    else:  # DeepSpeed ZeRO, as FSDP2-equivalent sharding plus ZeRO's float32 master partition
        largest = 4 * block_max
        if par.kind == "zero2":
            weights = frozen_bytes + trainable * b
            grads = trainable * b + trainable * 4 / n
        else:
            weights = (frozen_bytes + trainable * b) / n + largest
            grads = trainable * (b + 4) / n
        opt = trainable * 12 / n
        if par.offload_optimizer:
            opt = 0.0
            grads = trainable * b if par.kind == "zero2" else trainable * b / n
    # ---- copies ---------------------------------------------------------------------------------------------------
    shard = n if par.kind in ("fsdp", "zero3") else 1
    copies = 0.0
    if inputs.use_ema:
        copies += trainable * 4 / shard
    per_copy = trainable * 4 / shard if s.use_lora else params["total"] * b / shard
    copies += s.policy_copies * per_copy  # the old policy, EMA reference, sampling copy of the algorithm's spec
    if s.teacher_kind == "lora":  # each teacher a further adapter, as large as the trained one (its rank assumed)
        copies += s.teachers * trainable * 4 / shard
    elif s.teacher_kind == "model":  # another transformer (or a merged copy for full fine-tuning), frozen
        copies += s.teachers * params["total"] * b / shard
    if s.beta > 0 and not s.use_lora and s.unsharded_reference:
        copies += params["total"] * b  # the frozen reference copy lives outside FSDP / ZeRO: whole on every GPU
        if n > 1 and par.kind in ("fsdp", "zero2", "zero3"):
            notes.append("full fine-tuning with beta > 0 keeps an unsharded reference copy of the transformer on "
                         "every GPU; beta: 0 removes it.")
    trajectories = inputs.gradient_accumulation_steps * measure.latent_bytes * (s.stored_per_step * s.trained_steps
                                                                                + 1)
    copies += trajectories
    # ---- reward ------------------------------------------------------------------------------------------------
    reward = sum(REWARD_MODEL_PARAMS[r][0] * REWARD_MODEL_PARAMS[r][1] for r in set(inputs.rewards)
                 if r in REWARD_MODEL_PARAMS)
    # ---- activations ---------------------------------------------------------------------------------------------
    # measured without the gradients, which are counted (sharded) above; with sequence parallelism every process holds
    # 1/S of each sample's tokens in the transformer (decoding stays whole: each process decodes the whole samples)
    sp = inputs.sequence_parallel_size
    activations = measure.training_bytes / sp
    rollout_transient = max(measure.rollout_bytes / sp, measure.decode_bytes)
    if sp > 1:
        notes.append(f"sequence_parallel_size {sp}: the transformer's activations / {sp} (each process holds 1/{sp} "
                     "of every sample's tokens), its FLOPs / "
                     f"{sp}; the {par.world_size // sp} data-parallel replica(s) of {sp} processes each train "
                     f"per_device_train_batch_size samples; decoding and rewards stay whole on each process.")
    dynamic = max(activations, rollout_transient)
    overhead = CUDA_CONTEXT_GB * GB + (NCCL_BUFFERS_GB * GB if n > 1 else 0.0) + FRAGMENTATION * dynamic
    persistent = weights + opt + copies + reward + overhead
    phases = {"rollout": (persistent + rollout_transient) / GB,
              "training": (persistent + grads + activations) / GB}
    breakdown = {"weights": weights + other_weights, "gradients": grads, "optimizer_states": opt,
                 "activations": activations, "copies": copies, "reward_model": reward, "overhead": overhead}
    phases = {k: v + other_weights / GB for k, v in phases.items()}
    breakdown = {k: v / GB for k, v in breakdown.items()}

    # ---- FLOPs and time -------------------------------------------------------------------------------------------
    ga = inputs.gradient_accumulation_steps
    decode = measure.decode_flops * math.ceil(s.micro_batch / max(1, s.decode_batch))
    # recomputation counted as run; the transformer's work split over the S processes of a sample
    step_flops = ga * ((measure.rollout_flops + measure.training_flops) / sp + decode)
    from .calibration import MFU

    compute_s = step_flops / (MFU * inputs.gpu.bf16_tflops * 1e12)
    comm_bytes = _collective_bytes(par, params, trainable, train_bytes, b, s, ga)
    sp_bytes = sequence_parallel_bytes(inputs.spec, measure, s, ga, sp)
    comm_s = (comm_bytes + sp_bytes) / (inputs.gpu.interconnect_gbs * 1e9) if n > 1 else 0.0
    method = "analytic" if par.kind in ("zero2", "zero3") else "fake_tensors"
    plan = Plan(inputs, breakdown, phases, step_flops, compute_s + comm_s, comm_s, method, notes)
    plan.sequence_parallel_bytes = sp_bytes
    if par.kind in ("zero2", "zero3") and not s.use_lora:
        plan.deepspeed_check = _deepspeed_states(par, params["total"], block_max, n)
    return plan


def frozen_weight_bytes(frozen: float, linear: float, itemsize: int, quantization: str | None) -> float:
    """Bytes of ``frozen`` parameters, of which ``linear`` are in linear layers: 4-bit (0.5 bytes plus a 1/16 scale)
    or 8-bit (1 byte plus a 1/64 scale) bitsandbytes weights for the linear layers, the model dtype for the rest."""
    if quantization == "4bit":
        return linear * (0.5 + 1 / 16) + (frozen - linear) * itemsize
    if quantization == "8bit":
        return linear * (1 + 1 / 64) + (frozen - linear) * itemsize
    return frozen * itemsize


def other_weight_bytes(spec: ModelSpec, itemsize: int, offload_text_encoders: bool) -> float:
    """Bytes of the pipeline's weights beside the transformer: the text encoders (none when offloaded), the VAE and
    the other components (e.g. LTX-2's audio VAE), in the model dtype."""
    other = spec.text_encoder_total * itemsize if not offload_text_encoders else 0.0
    other += vae_params(spec) * itemsize
    other += sum(component_params(*part) for name, part in spec.components.items()
                 if name not in spec.text_encoder_params) * itemsize
    return other


def vae_params(spec: ModelSpec) -> float:
    key = (spec.vae_class, repr(sorted(spec.vae_config.items())))
    if key not in _VAE_PARAMS:
        import diffusers

        with torch.device("meta"):
            vae = getattr(diffusers, spec.vae_class).from_config(spec.vae_config)
        _VAE_PARAMS[key] = float(sum(p.numel() for p in vae.parameters()))
    return _VAE_PARAMS[key]


_VAE_PARAMS: dict[tuple, float] = {}


def component_params(class_name: str, config: dict[str, Any]) -> float:
    key = (class_name, repr(sorted(config.items())))
    if key not in _VAE_PARAMS:
        from .step import build_component

        _VAE_PARAMS[key] = float(sum(p.numel() for p in build_component(class_name, config).parameters()))
    return _VAE_PARAMS[key]


def _collective_bytes(par: Parallelism, params: dict[str, float], trainable: float, train_bytes: int, b: int,
                      s: StepSettings, ga: int) -> float:
    """Bytes each GPU sends per optimizer step (ring collectives: (N-1)/N of the buffer per all-gather or
    reduce-scatter, twice that per all-reduce)."""
    n = par.world_size
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    if par.kind == "ddp" or par.kind == "zero2":
        return 2 * ring * trainable * train_bytes
    # FSDP2 / ZeRO-3: every forward gathers the parameters; every backward gathers them again and reduce-scatters
    # the gradients. A trained pass holds K timesteps (train_timesteps_per_pass): ceil(T / K) passes
    trained = s.trained_pass_count
    extra = len(s.frozen_forwards)  # the reference, a teacher, the old policy: forwards without gradient
    chain = max(1, s.backprop_steps)  # a reward-gradient chain: that many forwards (and recomputations) a pass
    forwards = ga * (s.sampling_passes + trained * chain * (2 + extra))
    backwards = ga * trained
    return ring * (forwards * params["total"] * b + backwards * (params["total"] * b + trainable * train_bytes))


def attention_layers(spec: ModelSpec) -> int:
    """The self (or joint) attention layers a sample's tokens pass per transformer call: one per block (Wan, LTX-2's
    video stream, HunyuanVideo 1.5, FLUX.1's double and single blocks, ...): the blocks of every depth key."""
    from .step import DEPTH_KEYS

    return sum(int(spec.transformer_config.get(k, 0) or 0) for k in DEPTH_KEYS)


def sequence_parallel_bytes(spec: ModelSpec, measure: StepMeasure, s: StepSettings, ga: int, size: int) -> float:
    """Bytes each GPU sends per optimizer step in Ulysses' all-to-alls (``sequence_parallel_size = S``).

    A split attention layer exchanges four ``(rows, L, H, D)`` tensors per forward (Q, K, V before the attention,
    the output after it) and four per backward (the output's gradient, then dQ, dK, dV). Each process holds 1/S of
    the tokens and sends (S - 1)/S of its share, so a tensor of ``X`` bytes (the block's input over the whole
    sequence, image and text streams, CFG's rows included: ``block_io_bytes``) costs ``X (S - 1) / S^2`` per GPU:

        bytes = ga x passes x layers x 4 X (S - 1) / S^2,

    with ``passes`` = the rollout's transformer calls per sample plus, per trained step, its forward and backward,
    gradient checkpointing's recomputed forward and the forwards without gradient (the KL reference, DiffusionNFT's
    old policy, a distillation teacher). Cross-attention to a text that is not split (Wan's) exchanges nothing and
    is not counted; LTX-2's sound stream and cross-modal attention are small next to its video and are not either."""
    if size <= 1:
        return 0.0
    trained = s.trained_passes or s.trained_steps
    without_gradient = len(s.frozen_forwards)  # the algorithm spec's: the reference, a teacher, the old policy
    passes = (s.rollout_passes or s.num_inference_steps) + trained * (2 + int(s.checkpointing) + without_gradient)
    return ga * passes * attention_layers(spec) * 4 * measure.block_io_bytes * (size - 1) / size ** 2


def _deepspeed_states(par: Parallelism, total_params: float, largest_layer: float, n: int) -> dict[str, float]:
    """DeepSpeed's own estimate of the model states per GPU (GB) for full fine-tuning, next to ours."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        if par.kind == "zero2":
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            _, gpu = estimate_zero2_model_states_mem_needs(int(total_params), num_gpus_per_node=n, cpu_offload=False)
        else:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            _, gpu, *_ = estimate_zero3_model_states_mem_needs(int(total_params), int(largest_layer),
                                                           num_gpus_per_node=n, cpu_offload=False)
    return {"deepspeed_model_states_gb": gpu / GB}


def plan_inputs(script_args: Any, model_args: Any, training_args: Any, parallel: Parallelism, gpu: GPU,
                spec: ModelSpec | None = None) -> PlanInputs:
    spec = spec or load_model_spec(str(model_args.model_name_or_path))
    settings = settings_from_args(training_args, model_args, script_args.trainer)
    return PlanInputs(spec=spec, settings=settings, parallel=parallel, gpu=gpu,
                      gradient_accumulation_steps=int(training_args.gradient_accumulation_steps),
                      optimizer=str(getattr(training_args.optim, "value", training_args.optim)),
                      quantization=getattr(training_args, "quantization", None),
                      use_ema=bool(getattr(training_args, "use_ema", False)),
                      offload_text_encoders=bool(getattr(training_args, "offload_text_encoders", False)),
                      rewards=_scored_rewards(script_args, training_args), trained_steps=settings.trained_steps,
                      sequence_parallel_size=int(training_args.sequence_parallel_size or 1))


def _scored_rewards(script_args: Any, training_args: Any) -> tuple[str, ...]:
    """The rewards a run scores: ``reward_funcs``, and the constrained rewards outside them (``reward_constraints``:
    scored with weight 0, their models loaded all the same)."""
    names = [*(script_args.reward_funcs or ()), *(getattr(training_args, "reward_constraints", None) or {})]
    return tuple(dict.fromkeys(str(n) for n in names))


def check_wrap_classes(spec: ModelSpec, parallel: Parallelism) -> None:
    """FSDP's ``fsdp_transformer_layer_cls_to_wrap`` must name classes of the model: the trainer keeps the names its
    model has (one config may list several families' blocks, ``fsdp8_video.yaml``) and refuses a list naming none of
    them (accelerate would, after the weights are loaded). Checked here on the model built on the meta device."""
    if parallel.kind != "fsdp" or not parallel.wrap_classes:
        return
    from .step import build_on_meta

    transformer, _ = build_on_meta(spec)
    present = {type(m).__name__ for m in transformer.modules()}
    if not any(c in present for c in parallel.wrap_classes):
        blocks = sorted(c for c in present if c.endswith(("Block", "Model")) and "Embed" not in c)
        raise ValueError(f"{parallel.source}: fsdp_transformer_layer_cls_to_wrap names {', '.join(parallel.wrap_classes)}, "
                         f"none of which {spec.name} ({spec.transformer_class}) has; accelerate would refuse to wrap it. "
                         f"Its block classes: {', '.join(blocks)}. Use the family's config (accelerate_configs/"
                         "fsdp8_flux.yaml, fsdp8_qwenimage.yaml, fsdp8_wan.yaml, fsdp8_flux2.yaml, fsdp8_video.yaml) "
                         "or list those classes.")


def make_plan(inputs: PlanInputs) -> Plan:
    measure, smallest, blocks = measure_full_depth(inputs.spec, inputs.settings)
    plan = compose(inputs, measure, smallest, blocks)
    plan.measure = measure
    return plan


def plan_with_timesteps_per_pass(plan: Plan, per_pass: int) -> Plan:
    """``plan``'s recipe re-planned with K = ``per_pass`` trained timesteps per pass (a new fake-tensor measurement of
    the trained pass; measured steps are kept per settings for the process)."""
    inputs = plan.inputs
    if per_pass == inputs.settings.timesteps_per_pass:
        return plan
    return make_plan(dataclasses.replace(inputs, settings=dataclasses.replace(inputs.settings,
                                                                               timesteps_per_pass=per_pass)))


def largest_timesteps_per_pass(plan: Plan) -> Plan | None:
    """The plan of the largest K (``train_timesteps_per_pass``, 1 .. the trained timesteps T) whose peak fits the GPU,
    or None when even K = 1 does not fit. A pass's activations grow with its rows, so the peak does not fall as K
    grows: K = T is planned first; otherwise a search between the largest K known to fit and the smallest known not
    to, each guess read off the straight line through their peaks (a pass's activations are close to linear in
    its rows), so that a recipe takes about four plans."""
    s = plan.inputs.settings
    parts = max(1, s.trained_steps)
    memory = plan.inputs.gpu.memory_gb
    plans = {s.timesteps_per_pass: plan}

    def at(per_pass: int) -> Plan:
        if per_pass not in plans:
            plans[per_pass] = plan_with_timesteps_per_pass(plan, per_pass)
        return plans[per_pass]

    if at(parts).peak_gb <= memory:
        return at(parts)
    if at(1).peak_gb > memory:
        return None
    low, high = 1, parts  # at(low) fits, at(high) does not
    while high - low > 1:
        low_peak, high_peak = at(low).peak_gb, at(high).peak_gb
        guess = low + int((memory - low_peak) / (high_peak - low_peak) * (high - low)) if high_peak > low_peak \
            else low
        guess = min(max(guess, low + 1), high - 1)
        if at(guess).peak_gb <= memory:
            low = guess
        else:
            high = guess
    return at(low)


def timesteps_per_pass_suggestion(plan: Plan) -> dict[str, Any] | None:
    """The ``train_timesteps_per_pass`` to suggest, with its peak and step time, or None when it is the plan's own K
    or no K fits: the largest K that fits (`largest_timesteps_per_pass`), evened out to the smallest K that needs as
    few passes (`even_timesteps_per_pass`: 9 timesteps fit at K = 6 take 2 passes, as at K = 5, with a smaller
    peak)."""
    from ..trainer.timestep_passes import even_timesteps_per_pass

    s = plan.inputs.settings
    largest = largest_timesteps_per_pass(plan)
    if largest is None:
        return None
    k_max = largest.inputs.settings.timesteps_per_pass
    k = even_timesteps_per_pass(s.trained_steps, k_max)
    if k == s.timesteps_per_pass:
        return None
    chosen = plan_with_timesteps_per_pass(plan, k)
    passes = int(chosen.inputs.settings.trained_pass_count)
    words = "all" if k == s.trained_steps else str(k)
    return {"change": f"train_timesteps_per_pass: {words} ({passes} pass{'es' if passes > 1 else ''} of the "
                      f"{s.trained_steps} trained timesteps; the largest K that fits: {k_max})",
            "peak_memory_gb": round(chosen.peak_gb, 2), "est_step_time_s": round(chosen.step_time_s, 2)}


def suggestions(plan: Plan) -> list[dict[str, Any]]:
    """Concrete changes, each re-planned (a new fake-tensor measurement where the step's shapes change)."""
    inputs = plan.inputs
    s, par = inputs.settings, inputs.parallel
    out: list[dict[str, Any]] = []

    def add(change: str, new_inputs: PlanInputs) -> None:
        try:
            peak = make_plan(new_inputs).peak_gb
        except Exception as err:  # a change this model cannot take is reported, not fatal
            out.append({"change": change, "peak_memory_gb": None, "error": str(err)[:200]})
            return
        out.append({"change": change, "peak_memory_gb": round(peak, 2)})

    if not s.checkpointing:
        add("activation_checkpointing: true",
            dataclasses.replace(inputs, settings=dataclasses.replace(s, checkpointing=True)))
    if not s.use_lora:
        add("use_peft: true (LoRA r=32)", dataclasses.replace(
            inputs, settings=dataclasses.replace(s, use_lora=True, lora_r=32, lora_alpha=64)))
    if "8bit" not in inputs.optimizer:
        add("optim: adamw_bnb_8bit", dataclasses.replace(inputs, optimizer="adamw_bnb_8bit"))
    if s.micro_batch > 1:
        half = s.micro_batch // 2
        add(f"per_device_train_batch_size: {half} (gradient_accumulation_steps: "
            f"{inputs.gradient_accumulation_steps * 2})",
            dataclasses.replace(inputs, gradient_accumulation_steps=inputs.gradient_accumulation_steps * 2,
                                settings=dataclasses.replace(s, micro_batch=half, decode_batch=min(s.decode_batch,
                                                                                                   half))))
    if s.decode_batch > 1:
        add("vae_decode_batch_size: 1", dataclasses.replace(inputs, settings=dataclasses.replace(s, decode_batch=1)))
    measure = plan.measure
    if not s.vae_tiling and measure is not None and measure.decode_bytes > measure.rollout_bytes:
        add("vae_tiling: true", dataclasses.replace(inputs, settings=dataclasses.replace(s, vae_tiling=True)))
    if s.trained_steps > 1:  # the largest K that fits, whichever way it moves from the recipe's
        try:
            suggestion = timesteps_per_pass_suggestion(plan)
        except Exception as err:  # a change this model cannot take is reported, not fatal
            suggestion = {"change": "train_timesteps_per_pass", "peak_memory_gb": None, "error": str(err)[:200]}
        if suggestion is not None:
            out.append(suggestion)
    if not inputs.offload_text_encoders and inputs.spec.text_encoder_total:
        add("cache_prompt_embeddings: true, offload_text_encoders: true",
            dataclasses.replace(inputs, offload_text_encoders=True))
    if par.kind == "fsdp" and not par.offload_params:
        add("fsdp_offload_params: true (CPU offload)", dataclasses.replace(
            inputs, parallel=dataclasses.replace(par, offload_params=True)))
    elif par.kind in ("zero2", "zero3") and not par.offload_optimizer:
        add("offload_optimizer_device: cpu", dataclasses.replace(
            inputs, parallel=dataclasses.replace(par, offload_optimizer=True)))
    sp = inputs.sequence_parallel_size
    if par.world_size >= 2 * sp and par.world_size % (2 * sp) == 0 and inputs.spec.family in sequence_parallel_families():
        add(f"sequence_parallel_size: {2 * sp}", dataclasses.replace(
            inputs, sequence_parallel_size=2 * sp, settings=dataclasses.replace(s, split_tokens=True)))
    more = max(2, par.world_size * 2)
    target = par if par.kind in ("fsdp", "zero2", "zero3") else Parallelism(
        "fsdp", more, (), True, False, False, par.mixed_precision, "suggested")
    add(f"{more} GPUs ({'FSDP2' if target.kind == 'fsdp' else target.kind})",
        dataclasses.replace(inputs, parallel=target.with_world(more) if target is par else
                            dataclasses.replace(target, world_size=more)))
    return out


def sequence_parallel_families() -> set[str]:
    """The adapter families whose tokens can be split over processes (no ``sequence_parallel_refusal``)."""
    from ..models import adapter_classes

    return {cls.family for cls in adapter_classes() if not cls.sequence_parallel_refusal}


__all__ = ["Plan", "PlanInputs", "REWARD_MODEL_PARAMS", "attention_layers", "check_wrap_classes", "compose",
           "largest_timesteps_per_pass", "make_plan", "plan_inputs", "plan_with_timesteps_per_pass",
           "sequence_parallel_bytes", "sequence_parallel_families", "settings_from_args", "suggestions",
           "timesteps_per_pass_suggestion"]
