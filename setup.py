"""Packaging for flowgrpo (src layout).

Lower bounds are the versions the test suite runs with. torch is deliberately unpinned here: choose the
CPU or CUDA build at install time (see the Makefile and README).
"""

import ast
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# The rewards each reward module registers: one entry point per reward, so that asking for a reward imports its module
# only (flowgrpo.plugins). The modules of flowgrpo.rewards are kept equal to
# flowgrpo.rewards.registry.BUILTIN_REWARD_MODULES, and the names to what each module registers, by a test
# (tests/rewards/test_reward_plugins.py).
BUILTIN_REWARDS = {
    "flowgrpo.rewards.ocr": ("ocr",),
    "flowgrpo.rewards.jpeg": ("jpeg_compressibility", "jpeg_incompressibility"),
    "flowgrpo.rewards.clip_scorers": ("aesthetic", "clipscore", "pickscore", "pickscore_rank", "image_similarity"),
    "flowgrpo.rewards.remote": ("remote",),
    "flowgrpo.rewards.vlm_judge": ("vlm_judge",),
    "flowgrpo.rewards.geneval": ("geneval",),
    "flowgrpo.rewards.imagereward": ("imagereward",),
    "flowgrpo.rewards.hpsv2": ("hpsv2",),
    "flowgrpo.rewards.hpsv3": ("hpsv3",),
    "flowgrpo.rewards.unifiedreward": ("unifiedreward",),
    "flowgrpo.rewards.vqascore": ("vqascore",),
    "flowgrpo.rewards.deqa": ("deqa",),
    "flowgrpo.rewards.editreward": ("editreward",),
    "flowgrpo.rewards.edit_judges": ("editscore", "unifiedreward_edit", "rationalrewards_edit"),
    "flowgrpo.rewards.clap": ("clap",),
    "flowgrpo.rewards.videoalign": ("videoalign",),
    "flowgrpo.rewards.geneval2": ("geneval2",),
    # the toy world's (flowgrpo.toy)
    "flowgrpo.toy.rewards": ("toy_color", "toy_shape", "toy_position", "toy_count", "toy_geneval", "toy_shape_score",
                             "toy_smooth_shape_color"),
    "flowgrpo.toy.hackable": ("toy_area",),
}


def _families() -> list[str]:
    """The names of flowgrpo.models.FAMILIES, read from the source (nothing of flowgrpo is imported here)."""
    tree = ast.parse((HERE / "src/flowgrpo/models/__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "FAMILIES":
            return list(ast.literal_eval(node.value))
    raise RuntimeError("src/flowgrpo/models/__init__.py defines no FAMILIES table")


# The model folders a recipe's build_tiny_pipeline_if_missing builds, by name (flowgrpo.cli.model_folders, where
# BUILTIN_MODEL_FOLDERS is the same table): the tiny pipeline of every family and the toy world.
MODEL_FOLDERS = {**{family: "flowgrpo.testing.model_folder:TINY_PIPELINE" for family in _families()},
                 "toy": "flowgrpo.toy.model_folder:TOY_WORLD"}
# The algorithms of flowgrpo.trainer.registry (name, the module declaring its SPEC), in the documentation's order.
BUILTIN_TRAINERS = (("flow_grpo", "flow_grpo_config"), ("diffusion_nft", "nft_config"), ("awm", "awm_config"),
                    ("diffusion_dpo", "dpo_config"), ("dgpo", "dgpo_config"), ("crd", "crd_config"),
                    ("diffusion_opd", "opd_config"), ("reward_backprop", "reward_backprop_config"))
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "src/flowgrpo/__init__.py").read_text()).group(1)

INSTALL_REQUIRES = [
    "torch>=2.11.0",
    "diffusers>=0.42.1",
    "transformers>=5.17.0",
    "peft>=0.21.2",
    "accelerate>=1.15.0",
    "trl>=1.16.0",
    "datasets>=5.2.0",
    "huggingface_hub>=1.33.0",
    "safetensors>=0.8.0",
    "pillow>=11.0.0",
    "numpy>=2.0.0",
    "pyyaml>=6.0",
    "sentencepiece>=0.2.0",
    "protobuf>=4.25",
    "matplotlib>=3.9",
    "tqdm>=4.66",
    "psutil>=5.9",
    # Text cleaning of the open_clip tokenizer (the hpsv2 reward).
    "ftfy>=6.1",
]

EXTRAS = {
    # Bundled PP-OCR detection/recognition models as ONNX (offline on CPU) and a fast edit distance.
    "ocr": ["rapidocr>=3.10.0", "onnxruntime>=1.30.0", "rapidfuzz>=3.14.0"],
    # PaddleOCR itself downloads its models at run time; optional backend.
    "paddle": ["paddleocr>=3.7.0"],
    "wandb": ["wandb>=0.31.0"],
    "tensorboard": ["tensorboard>=2.21.0"],
    "deepspeed": ["deepspeed>=0.19.8"],
    "bnb": ["bitsandbytes>=0.50.2"],
    # The `geneval` reward: transformers' Mask2Former builds its (training) matcher with scipy.
    "geneval": ["scipy>=1.11"],
    # The `clap` reward resamples generated sound with scipy's polyphase resampler.
    "audio": ["scipy>=1.11"],
    # The `videoalign` reward's MP4 round trip (H.264 encoding and decoding with FFmpeg's libx264, bundled).
    "video": ["av>=14.0.0"],
    # rollout_backend / reward_backend "ray": rollout and reward workers on a Ray cluster (token authentication needs
    # Ray >= 2.52; tested with 2.60).
    "ray": ["ray>=2.52.0"],
    # import-linter: the architecture rules of pyproject.toml, checked by tests/cli/test_architecture.py.
    "dev": ["pytest>=9.2.0", "pytest-xdist>=3.8.0", "ruff>=0.17.5", "tensorboard>=2.21.0", "wandb>=0.31.0",
            "scipy>=1.11", "av>=14.0.0", "import-linter>=2.16"],
}
EXTRAS["all"] = sorted({req for name, reqs in EXTRAS.items() for req in reqs})

setup(
    name="flowgrpo",
    version=VERSION,
    description="Online RL (Flow-GRPO and family) for flow-matching text-to-image models, the Hugging Face way",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    package_dir={"": "src"},
    packages=find_packages("src"),
    package_data={
        # The toy world of the recipes and the demo (4.4 MB, made by scripts/make_toy_world.py --ship).
        "flowgrpo.toy": ["shipped_world/*", "shipped_world/*/*"],
        "flowgrpo.plan": ["model_configs/*.json"],  # the planner's model sizes
    },
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        # Rewards by name: the module a reward's name points at is imported when that reward is asked for
        # (flowgrpo.rewards.registry); a third-party package adds its rewards to the same group.
        "flowgrpo.rewards": [f"{name} = {module}" for module, names in BUILTIN_REWARDS.items() for name in names],
        # Builders of model folders (flowgrpo.cli.model_folders), loaded by the name a recipe gives.
        "flowgrpo.model_folders": [f"{name} = {value}" for name, value in MODEL_FOLDERS.items()],
        # Algorithms (flowgrpo.trainer.registry): each entry point names an AlgorithmSpec; a third-party package adds
        # its trainers to the same group. Kept equal to flowgrpo.trainer.registry.BUILTIN_TRAINERS by a test.
        "flowgrpo.trainers": [f"{name} = flowgrpo.trainer.algorithms.{module}:SPEC" for name, module in BUILTIN_TRAINERS],
        "console_scripts": [
            "flowgrpo=flowgrpo.cli.command:main",
            "flowgrpo-reward-server=flowgrpo.rewards.server:main",
            "flowgrpo-plan=flowgrpo.plan:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
