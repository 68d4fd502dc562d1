"""The benchmarks of ``flowgrpo evaluate``: their prompts, their sampling protocol and how they are scored.

=========== ============================================ ================== ==========================================
benchmark   prompts (``--metadata``)                      images per prompt  scored by
=========== ============================================ ================== ==========================================
geneval     data/geneval/evaluation_metadata.jsonl (553)  4                  the ``geneval`` detector rules (accuracy)
geneval2    data/geneval2/geneval2_data.jsonl (800)       1                  the ``geneval2`` reward (Soft-TIFA AM, GM)
ocr         data/ocr/test.txt                             1                  the ``ocr`` reward
pickscore   data/pickscore/test.txt                       1                  the ``pickscore`` reward (PickScore scale)
toy         <toy world>/prompts_eval.txt                  4                  the toy world's attribute checks
=========== ============================================ ================== ==========================================

``scripts/prepare_data.py geneval|geneval2|ocr|pickscore`` downloads the prompt files. GenEval2's evaluation script
takes one image per prompt (a ``{prompt: image path}`` file), hence 1 here; its sampler is Flow-GRPO's evaluation
protocol below (GenEval 2 prescribes none). Every benchmark samples
deterministically (the Euler ODE of the flow, as the trainers' evaluation does) from fixed per-image seeds. The
published protocol of Flow-GRPO's SD3.5-Medium evaluation (``scripts/train_sd3.py`` ``eval`` with
``config/grpo.py``: ``eval_num_steps = 40``, ``guidance_scale = 4.5``, ``resolution = 512``, text embeddings of
``max_sequence_length = 128``, the empty negative prompt, ``noise_level = 0``) is the default of geneval, ocr and
pickscore when the model is SD3.5-Medium, the model that protocol was published for; GenEval's own generator draws
4 images per prompt after ``seed_everything(42)``. Any other model samples at its own settings (``MODEL_SETTINGS``:
steps, guidance, size, text length), resolved from its component configs as the trainers resolve theirs
(:mod:`flowgrpo.models.defaults`; the toy world: its ``toy_world.json``). A recipe (``--recipe``) replaces these with
its evaluation settings, and flags replace both; a value the model cannot take is refused with the trainers' words.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

#: Image seeds: image ``n`` of prompt ``i`` starts from ``torch.Generator().manual_seed(seed + SEED_STRIDE * n + i)``.
SEED_STRIDE = 100_000

ODE_SOLVERS = ("euler", "dpmpp_2m")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def image_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of prompt ``prompt_index``: ``seed + 100000 * sample_index +
    prompt_index``. Every image has its own seed, so its initial noise does not depend on the batch it was drawn
    in, on the process that drew it or on a resumed run (distinct for fewer than 100000 prompts; the pixels can still
    differ in the last bit where batched arithmetic rounds differently)."""
    return int(seed) + SEED_STRIDE * int(sample_index) + int(prompt_index)


#: the settings of a protocol that belong to the model (``None`` in a protocol: the evaluated model's own)
MODEL_SETTINGS = ("num_inference_steps", "guidance_scale", "height", "width", "max_sequence_length")


@dataclass(frozen=True)
class SamplingProtocol:
    """How a benchmark's images are made: deterministic sampling with these settings (all part of the result).

    A model setting (:data:`MODEL_SETTINGS`) left ``None`` is the evaluated model's own, resolved before the run.
    """

    num_inference_steps: int | None = 40
    guidance_scale: float | None = 4.5
    height: int | None = 512
    width: int | None = 512
    max_sequence_length: int | None = 128
    negative_prompt: str = ""
    images_per_prompt: int = 1
    seed: int = 42
    ode_solver: str = "euler"
    dtype: str = "auto"

    def check(self) -> None:
        """Raise ``ValueError`` naming the setting for a value no run can use (a model setting still ``None`` is the
        model's own, checked once resolved)."""
        for name in ("num_inference_steps", "height", "width", "max_sequence_length", "images_per_prompt"):
            value = getattr(self, name)
            if value is None and name in MODEL_SETTINGS:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ValueError(f"guidance_scale={self.guidance_scale} must be >= 0 (1 = no guidance).")
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"ode_solver={self.ode_solver!r} is not a solver; choose one of {list(ODE_SOLVERS)}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not valid; choose one of {list(DTYPES)}.")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: where its prompts come from, its default model and protocol, and its rewards.

    ``rewards`` is empty for GenEval, which is scored by its own detector rules (``flowgrpo.rewards.geneval``).
    """

    name: str
    description: str
    default_metadata: str | None
    protocol: SamplingProtocol
    default_model: str | None = "stabilityai/stable-diffusion-3.5-medium"
    rewards: tuple[str, ...] = ()
    reward_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    prepare_hint: str = ""

    @property
    def scored_by_rewards(self) -> bool:
        return bool(self.rewards)


_FLOW_GRPO_EVAL = SamplingProtocol(num_inference_steps=40, guidance_scale=4.5, height=512, width=512,
                                   max_sequence_length=128, negative_prompt="", images_per_prompt=1, seed=42)

BENCHMARKS: dict[str, Benchmark] = {
    "geneval": Benchmark(
        "geneval", "GenEval (553 compositional prompts, 6 tasks; accuracy per task and overall)",
        "data/geneval/evaluation_metadata.jsonl", replace(_FLOW_GRPO_EVAL, images_per_prompt=4),
        prepare_hint="python scripts/prepare_data.py geneval"),
    "geneval2": Benchmark(
        "geneval2", "GenEval 2 (800 compositional prompts; Soft-TIFA AM and GM of a Qwen3-VL judge, per skill and "
        "per atomicity)", "data/geneval2/geneval2_data.jsonl", _FLOW_GRPO_EVAL, rewards=("geneval2",),
        prepare_hint="python scripts/prepare_data.py geneval2"),
    "ocr": Benchmark(
        "ocr", "visual text rendering: OCR accuracy of the quoted text of Flow-GRPO's OCR test prompts",
        "data/ocr/test.txt", _FLOW_GRPO_EVAL, rewards=("ocr",), prepare_hint="python scripts/prepare_data.py ocr"),
    "pickscore": Benchmark(
        "pickscore", "human preference: PickScore of Flow-GRPO's PickScore test prompts (PickScore's own scale)",
        "data/pickscore/test.txt", _FLOW_GRPO_EVAL, rewards=("pickscore",),
        prepare_hint="python scripts/prepare_data.py pickscore"),
    "toy": Benchmark(
        "toy", "the toy world's held-out prompts: colour, shape, count and position accuracy",
        None, SamplingProtocol(num_inference_steps=None, guidance_scale=None, height=None, width=None,
                               max_sequence_length=None, images_per_prompt=4, seed=0),  # the world's toy_world.json
        default_model=None,
        rewards=("toy_color", "toy_shape", "toy_count", "toy_position", "toy_geneval"),
        reward_kwargs={"toy_geneval": {"mode": "all"}}),
}


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        import difflib

        close = difflib.get_close_matches(name, list(BENCHMARKS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"--benchmark {name!r} is not a benchmark.{hint} Choose one of {list(BENCHMARKS)}.")
    return BENCHMARKS[name]


# --------------------------------------------------------------------------------------------------------------------
# recipes
# --------------------------------------------------------------------------------------------------------------------

#: recipe key -> protocol field, first key present wins (the evaluation settings before the training ones)
_RECIPE_PROTOCOL_KEYS: dict[str, tuple[str, ...]] = {
    "num_inference_steps": ("eval_num_inference_steps", "num_inference_steps"),
    "guidance_scale": ("eval_guidance_scale", "guidance_scale"),
    "height": ("height", "resolution"),
    "width": ("width", "resolution"),
    "max_sequence_length": ("max_sequence_length",),
    "negative_prompt": ("negative_prompt",),
    "dtype": ("dtype",),
}


@dataclass(frozen=True)
class RecipeSettings:
    """What ``flowgrpo evaluate`` takes from a training recipe: its evaluation sampler, model, prompts and rewards."""

    protocol_overrides: dict[str, Any]
    model: str | None = None
    metadata: str | None = None
    rewards: tuple[str, ...] = ()
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


def read_recipe_settings(path: str | os.PathLike) -> RecipeSettings:
    """The evaluation settings of a training recipe (``recipes/*.yaml``): the sampler of its evaluation
    (``eval_num_inference_steps``, ``eval_guidance_scale``, ``resolution``/``height``/``width``,
    ``max_sequence_length``, ``negative_prompt``, ``dtype``; DiffusionNFT's ``sampler`` as the ODE solver), its model,
    its test prompts (``eval_dataset_name`` or ``dataset_name`` + ``dataset_test_split``) and its rewards with
    their ``reward_kwargs``. Other keys (the training's) are ignored."""
    from ..cli.parser import load_recipe

    recipe = load_recipe(path)
    overrides: dict[str, Any] = {}
    for target, keys in _RECIPE_PROTOCOL_KEYS.items():
        for key in keys:
            if recipe.get(key) is not None:
                overrides[target] = recipe[key]
                break
    if recipe.get("sampler"):  # the trainers with a `sampler` setting evaluate with that deterministic solver
        overrides["ode_solver"] = recipe["sampler"]
    if "guidance_scale" in overrides:
        overrides["guidance_scale"] = float(overrides["guidance_scale"])
    reward_kwargs = recipe.get("reward_kwargs") or {}
    if isinstance(reward_kwargs, str):
        reward_kwargs = json.loads(reward_kwargs)
    rewards = recipe.get("reward_funcs") or ()
    if isinstance(rewards, str):
        rewards = (rewards,)
    return RecipeSettings(overrides, recipe.get("model_name_or_path"), _recipe_test_prompts(recipe),
                          tuple(rewards), dict(reward_kwargs))


def _recipe_test_prompts(recipe: Mapping[str, Any]) -> str | None:
    """The file of a recipe's test prompts, when it names one that can be found."""
    from ..cli.data import PROMPT_FILE_SUFFIXES

    name = recipe.get("eval_dataset_name") or recipe.get("dataset_name")
    if not name:
        return None
    path = Path(str(name)).expanduser()
    if path.is_file():
        return str(path)
    split = recipe.get("dataset_test_split", "test") or "test"
    for stem in (split, f"{split}_metadata"):
        for suffix in PROMPT_FILE_SUFFIXES:
            candidate = path / f"{stem}{suffix}"
            if candidate.is_file():
                return str(candidate)
    return None


# --------------------------------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------------------------------

def read_benchmark_prompts(benchmark: Benchmark, metadata_path: str | os.PathLike) -> list[dict[str, Any]]:
    """One dict per prompt, in file order, each with a ``prompt`` (and its other columns, e.g. GenEval's ``tag``,
    ``include`` and ``exclude``; these become the prompt folder's ``metadata.jsonl`` line).

    GenEval reads the metadata JSONL line by line, as its generator does; the other benchmarks read any prompt file
    of the launch script (``.txt``, ``.jsonl``, ``.json``, ``.csv``, ``.parquet``). Raises ``ValueError`` naming the
    file and the command that downloads it.
    """
    path = Path(metadata_path).expanduser()
    if not path.is_file():
        hint = f" Download it with `{benchmark.prepare_hint}`, or" if benchmark.prepare_hint else ""
        raise ValueError(f"The {benchmark.name} prompts {str(metadata_path)!r} do not exist (relative paths are read "
                         f"from {Path.cwd()}).{hint} pass the file with --metadata PATH.")
    if benchmark.name == "geneval":
        return _read_geneval_metadata(path)
    if benchmark.name == "geneval2":
        return _read_geneval2_data(path)
    from ..cli.data import read_prompt_file
    from ..cli.parser import RecipeError

    try:
        dataset = read_prompt_file(path)
    except RecipeError as err:
        raise ValueError(str(err)) from err
    if "prompt" not in dataset.column_names:
        raise ValueError(f"{path} has no 'prompt' column (columns: {dataset.column_names}).")
    rows = [dict(row) for row in dataset]
    if not rows:
        raise ValueError(f"{path} holds no prompt.")
    return rows


def _read_geneval_metadata(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number} is not JSON: {err}.") from err
        missing = [k for k in ("prompt", "tag", "include") if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path} line {number} lacks {missing}: GenEval metadata lines hold a 'tag', an "
                             "'include' list and a 'prompt' (prompts/evaluation_metadata.jsonl of the GenEval "
                             "repository; `python scripts/prepare_data.py geneval` downloads it).")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompt.")
    return rows


def check_geneval2_row(row: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``row`` is a line of GenEval2's ``geneval2_data.jsonl``: a
    ``prompt``, an integer ``atom_count``, a ``vqa_list`` of [question, answer] strings and one ``skills`` entry per
    pair."""
    vqa = row.get("vqa_list") if isinstance(row, dict) else None
    skills = row.get("skills") if isinstance(row, dict) else None
    pairs = isinstance(vqa, list) and bool(vqa) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in vqa)
    if not (pairs and isinstance(row.get("prompt"), str) and isinstance(row.get("atom_count"), int)
            and isinstance(skills, list) and len(skills) == len(vqa)):
        raise ValueError(f"{where} is not a GenEval2 line: it needs a 'prompt', an integer 'atom_count', a 'vqa_list' "
                         f"of [question, answer] pairs and one 'skills' entry per pair (GenEval2's "
                         f"geneval2_data.jsonl; `python scripts/prepare_data.py geneval2` downloads it); got "
                         f"{json.dumps(row)[:200]}")


def _read_geneval2_data(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number} is not JSON: {err}.") from err
        check_geneval2_row(row, f"{path} line {number}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompt.")
    return rows


__all__ = [
    "BENCHMARKS", "DTYPES", "MODEL_SETTINGS", "ODE_SOLVERS", "SEED_STRIDE", "Benchmark", "RecipeSettings",
    "SamplingProtocol", "check_geneval2_row", "get_benchmark", "image_seed", "read_benchmark_prompts",
    "read_recipe_settings",
]
