"""Argument groups of the launch script besides the trainer's configuration (that of the registry's trainer the recipe
names): the trainer and the data (`ScriptArguments`) and the model (`ModelArguments`).

Every field can be set in a recipe (YAML, flat keys) or on the command line (``--key value``); see
:func:`flowgrpo.cli.parse_recipe`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from ..models import FAMILIES
from ..trainer.registry import BUILTIN_TRAINERS, DEFAULT_TRAINER, trainer_names

#: LoRA targets of the published Flow-GRPO SD3.5 recipes: the joint attention's image and text projections, the
#: default of the SD3, FLUX(-Kontext) and Qwen-Image(-Edit) families (FLUX's single-stream blocks have no ``add_*``
#: projections; peft skips them). Wan's default names its ``attn1`` / ``attn2`` modules instead; each family's
#: default is ``ModelFamilyAdapter.default_lora_target_modules``, applied by the trainer.
DEFAULT_LORA_TARGET_MODULES = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]

#: Accepted values of ``lora_init`` and what peft's ``init_lora_weights`` receives.
LORA_INITS = {
    "gaussian": "gaussian",  # A ~ N(0, 1/r), B = 0 (Flow-GRPO): the adapter starts as the identity
    "default": True,         # A Kaiming-uniform, B = 0 (peft's default): also the identity at start
    "true": True,
    "pissa": "pissa",
    "olora": "olora",
    "eva": "eva",
    "false": False,          # A and B random: the adapter changes the model from the first step (rarely wanted)
}

#: ``build_tiny_pipeline_if_missing`` values: the random tiny pipelines of ``flowgrpo.testing`` and the pretrained
#: toy world of ``flowgrpo.toy`` (a small SD3 pipeline that follows shape prompts).
TINY_PIPELINE_FAMILIES = (*FAMILIES, "toy")


@dataclass
class ScriptArguments:
    """Which trainer runs, where the prompts come from and which rewards score the images."""

    trainer: str = field(
        default=DEFAULT_TRAINER,
        metadata={"help": "The algorithm, a name of the trainer registry: "
                          + ", ".join(f"'{name}' ({BUILTIN_TRAINERS[name][2].partition(':')[2]})"
                                      if name in BUILTIN_TRAINERS else f"'{name}' (a plugin)"
                                      for name in trainer_names())
                          + ". 'flow_grpo' is Flow-GRPO and its variants (Flow-DPPO with policy_loss: dppo, "
                          "BranchGRPO with branch_steps). The other keys of a recipe are the fields of that trainer's "
                          "configuration; `--trainer diffusion_nft --help` lists them."},
    )

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Prompt dataset: a Hub dataset id (e.g. 'user/ocr-prompts'), a local file (.txt with one "
                          "prompt per line, .jsonl, .json, .csv or .parquet) used as the training split, or a local "
                          "folder holding one such file per split ('train.txt', 'test.jsonl', ...). Local files are "
                          "read relative to the working directory."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration (subset) name of a Hub dataset."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split used for training."})
    dataset_test_split: str | None = field(
        default="test",
        metadata={"help": "Split used for evaluation when it exists (a Hub dataset's split, or '<split>.<ext>' in a "
                          "local folder). Set to null / 'none' to train without evaluation."},
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={"help": "A separate evaluation set (Hub id, file or folder, as dataset_name); when it is a Hub id "
                          "or folder its dataset_test_split is used. Overrides dataset_test_split of dataset_name."},
    )
    prompt_column: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompt text; renamed to 'prompt'. Other columns are kept and passed "
                          "to the reward functions (e.g. the target text of OCR prompts)."},
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training prompts (quick runs)."},
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N evaluation prompts (evaluation cost is per prompt)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: registry names (see flowgrpo.rewards.list_rewards(), e.g. 'ocr', "
                          "'pickscore', 'remote') and/or 'package.module:function' paths (modules are imported from "
                          "the working directory or the installed packages). Weights: reward_weights; options: "
                          "reward_kwargs."},
    )


@dataclass
class ModelArguments:
    """Which pipeline is trained and how (LoRA or the full transformer)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A diffusers pipeline: Hub id (e.g. 'stabilityai/stable-diffusion-3.5-medium') or local "
                          "folder saved with save_pretrained."},
    )
    model_revision: str | None = field(
        default=None, metadata={"help": "Hub revision (branch, tag or commit) of model_name_or_path."},
    )
    build_tiny_pipeline_if_missing: str | None = field(
        default=None,
        metadata={"help": "A model family of flowgrpo.models.FAMILIES ("
                          + ", ".join(f"'{family}'" for family in FAMILIES)
                          + ") or 'toy': when model_name_or_path is a local folder that does not exist yet, build it "
                          "there first: the offline tiny random-weight pipeline of that family (flowgrpo.testing), or "
                          "the pretrained toy world (flowgrpo.toy, a few CPU minutes). For the CPU recipes; leave unset "
                          "for real models."},
    )
    tiny_pipeline_seed: int = field(
        default=0, metadata={"help": "Seed of the tiny pipeline built by build_tiny_pipeline_if_missing."},
    )
    use_peft: bool = field(
        default=True,
        metadata={"help": "Train a LoRA on the transformer (the Flow-GRPO default). False fine-tunes the whole "
                          "transformer."},
    )
    lora_r: int = field(default=32, metadata={"help": "LoRA rank (Flow-GRPO SD3.5-M: 32)."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (Flow-GRPO SD3.5-M: 64)."})
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "LoRA dropout. Keep 0: dropout makes the first-pass likelihood ratio differ from 1."},
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names (or suffixes) that get a LoRA. Default: the model family's attention "
                          "projections (its adapter's default_lora_target_modules), chosen by the trainer once it "
                          "knows the family; e.g. " + ", ".join(DEFAULT_LORA_TARGET_MODULES) + " for SD3 and the "
                          "other MMDiT families, to_q, to_k, to_v and to_out.0 of attn1 and attn2 for Wan (on each "
                          "expert of Wan 2.2 A14B)."},
    )
    lora_init: str = field(
        default="gaussian",
        metadata={"help": "LoRA initialisation (peft's init_lora_weights): " + ", ".join(LORA_INITS) + ". 'gaussian' "
                          "(Flow-GRPO) and 'default' start as the identity (B = 0)."},
    )

    def __post_init__(self):
        family = self.build_tiny_pipeline_if_missing
        if family is not None and family not in TINY_PIPELINE_FAMILIES:
            close = difflib.get_close_matches(str(family), TINY_PIPELINE_FAMILIES, n=3)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise ValueError(f"build_tiny_pipeline_if_missing={family!r} is not a tiny pipeline family; {hint}choose "
                             f"one of {list(TINY_PIPELINE_FAMILIES)}, or leave it unset for real models.")
