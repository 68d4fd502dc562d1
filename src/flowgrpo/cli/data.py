"""Prompt datasets for the launch script: Hub datasets, or local files in txt / jsonl / json / csv / parquet.

* ``.txt``: one prompt per line (blank lines skipped), the layout of the Flow-GRPO OCR and PickScore prompt sets.
* ``.jsonl``: one JSON object per line; ``.json``: a list of objects, or an object of equal-length column lists.
* ``.csv``: a header line, then one row per prompt (values are strings).
* ``.parquet``: any table.

A local folder holds one file per split, named ``<split>.<ext>`` or ``<split>_metadata.<ext>`` (Flow-GRPO's
GenEval layout), e.g. ``data/ocr/train.txt`` and ``data/ocr/test.txt``. The prompt column is renamed to
``prompt``; every other column is kept and reaches the reward functions (e.g. GenEval's object tags).

Editing sets have an ``image`` column (each prompt's source image). In a local file it holds paths; relative paths are
read relative to the file's own folder (so a folder with ``train.jsonl`` and ``images/`` moves as one).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from .arguments import ScriptArguments
from .parser import RecipeError

PROMPT_FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
_NO_SPLIT = ("", "none", "null", "no")


def looks_local(name: str) -> bool:
    """True when ``name`` can only be a local path (a Hub id is ``namespace/name`` with no extension)."""
    if os.path.exists(name):
        return True
    if name.startswith((".", "/", "~")) or name.endswith(("/", os.sep)) or "\\" in name:
        return True
    if Path(name).suffix.lower() in PROMPT_FILE_SUFFIXES:
        return True
    parts = name.split("/")
    if len(parts) > 2:
        return True
    return len(parts) == 2 and os.path.isdir(parts[0])


def read_prompt_file(path: str | os.PathLike) -> Any:
    """Read one prompt file (see the module docstring for the formats) into a ``datasets.Dataset``; relative source
    image paths (an ``image`` column; ``chosen`` / ``rejected`` of preference pairs) are resolved against the file's
    folder."""
    path = Path(path).expanduser()
    dataset = _read_prompt_file(path)
    folder = path.resolve().parent

    def resolve(value: Any) -> Any:
        return str(folder / value) if isinstance(value, str) and value and not Path(value).is_absolute() else value

    # image columns: editing families' source images, offline preference pairs' images
    for column in ("image", "chosen", "rejected"):
        if column in dataset.column_names and isinstance(dataset[0][column], str):
            dataset = dataset.map(lambda row, c=column: {c: resolve(row[c])})
    return dataset


def _read_prompt_file(path: Path) -> Any:
    from datasets import Dataset

    suffix = path.suffix.lower()
    if suffix not in PROMPT_FILE_SUFFIXES:
        raise RecipeError(f"Prompt file {str(path)!r} has an unsupported extension {suffix or '(none)'!r}; use one "
                          f"of {', '.join(PROMPT_FILE_SUFFIXES)}.")
    if not path.is_file():
        raise RecipeError(f"Prompt file not found: {str(path)!r}.")
    try:
        if suffix == ".txt":
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
            return Dataset.from_dict({"prompt": [ln for ln in lines if ln]})
        if suffix == ".jsonl":
            rows = []
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise RecipeError(f"{str(path)!r} line {n} is not JSON: {err}.") from err
                if isinstance(row, str):
                    row = {"prompt": row}
                if not isinstance(row, dict):
                    raise RecipeError(f"{str(path)!r} line {n} must be a JSON object (or a string), got "
                                      f"{type(row).__name__}.")
                rows.append(row)
            return _dataset_from_rows(rows)
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                return Dataset.from_dict(data)
            if isinstance(data, list):
                return Dataset.from_list([{"prompt": r} if isinstance(r, str) else r for r in data])
            raise RecipeError(f"{str(path)!r} must hold a list of objects or an object of columns.")
        if suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as f:
                return Dataset.from_list(list(csv.DictReader(f)))
        import pyarrow.parquet as pq

        return Dataset(pq.read_table(path))
    except RecipeError:
        raise
    except Exception as err:  # malformed file: name it and the format expected
        raise RecipeError(f"Cannot read prompt file {str(path)!r} as {suffix[1:]}: {type(err).__name__}: {err}") \
            from err


def _dataset_from_rows(rows: list[dict]) -> Any:
    """``Dataset.from_list(rows)`` over the union of the rows' keys; when Arrow cannot type a nested column (GenEval's ``"position": ["above", 0]``
    mixes a string and an integer), the nested columns (lists, objects) are stored as JSON strings instead, which the
    rewards reading them (e.g. ``geneval``) decode."""
    import pyarrow as pa
    from datasets import Dataset

    # Every key of every row (Dataset.from_list reads only the first row's keys): GenEval's ``exclude`` appears
    # in some lines only; the others get None.
    keys = list(dict.fromkeys(k for row in rows for k in row))
    rows = [{k: row.get(k) for k in keys} for row in rows]
    try:
        return Dataset.from_list(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        nested = {k for row in rows for k, v in row.items() if isinstance(v, (list, dict))}
        return Dataset.from_list([{k: json.dumps(v) if k in nested and v is not None else v for k, v in row.items()}
                                  for row in rows])


def _split_file(folder: Path, split: str) -> Path | None:
    for stem in (split, f"{split}_metadata"):
        for suffix in PROMPT_FILE_SUFFIXES:
            candidate = folder / f"{stem}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def _load_local(name: str, split: str | None, role: str) -> Any | None:
    """A split of a local file or folder; ``None`` when a folder has no file for an evaluation split."""
    path = Path(name).expanduser()
    if path.is_file():
        return read_prompt_file(path)
    if path.is_dir():
        found = _split_file(path, split) if split else None
        if found is None:
            if role == "eval":
                return None
            present = sorted(p.name for p in path.iterdir() if p.suffix.lower() in PROMPT_FILE_SUFFIXES)
            raise RecipeError(f"Folder {str(path)!r} has no '{split}' prompt file (looked for {split}.txt, "
                              f"{split}.jsonl, ...; found {present or 'no prompt files'}). Name the file after the "
                              "split or set dataset_train_split.")
        return read_prompt_file(found)
    hint = ""
    if "synthetic" in name.lower():
        hint = " Generate it with `python scripts/make_ocr_prompts.py --output_dir " + name.rstrip("/") + "`."
    elif "ocr" in name.lower() or "geneval" in name.lower() or "pickscore" in name.lower():
        hint = " Download the public prompt sets with `python scripts/prepare_data.py all --output_dir data`."
    raise RecipeError(f"{role} dataset {name!r} not found: no such file or folder (relative paths are read from "
                      f"{Path.cwd()}).{hint}")


def _load_hub(name: str, config: str | None, split: str | None, role: str) -> Any | None:
    import datasets

    try:
        splits = datasets.load_dataset(name, config)
    except Exception as err:
        raise RecipeError(f"Cannot load {role} dataset {name!r} (config {config!r}) from the Hub: "
                          f"{type(err).__name__}: {err}. For local prompts give a file path (.txt/.jsonl/.json/.csv/"
                          ".parquet) or a folder with train/test files.") from err
    if split in splits:
        return splits[split]
    if role == "eval":
        return None
    raise RecipeError(f"Dataset {name!r} has no split {split!r}; its splits are {list(splits)}. Set "
                      "dataset_train_split.")


def _finish(dataset: Any, args: ScriptArguments, role: str, source: str, limit: int | None) -> Any:
    columns = dataset.column_names
    column = args.prompt_column
    if column not in columns:
        raise RecipeError(f"The {role} prompts from {source!r} have no column {column!r} (columns: {columns}); set "
                          "prompt_column to the column that holds the prompt text.")
    if column != "prompt":
        if "prompt" in columns:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(column, "prompt")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    if len(dataset) == 0:
        raise RecipeError(f"The {role} prompts from {source!r} are empty.")
    bad = [i for i, p in enumerate(dataset["prompt"][:10_000]) if not isinstance(p, str)]
    if bad:
        raise RecipeError(f"The {role} prompts from {source!r} must be strings; row {bad[0]} holds "
                          f"{dataset[bad[0]]['prompt']!r}.")
    return dataset


def _load(name: str, config: str | None, split: str | None, role: str):
    if looks_local(name):
        return _load_local(name, split, role)
    return _load_hub(name, config, split, role)


def load_prompt_dataset(script_args: ScriptArguments) -> tuple[Any, Any | None]:
    """``(train_dataset, eval_dataset or None)`` as ``datasets.Dataset`` objects with a ``prompt`` column.

    The evaluation set is ``eval_dataset_name`` when given, else the ``dataset_test_split`` of ``dataset_name``
    when that split exists (a single local file has no test split). Raises :class:`RecipeError` (naming the path
    or column) for missing files, unknown splits, unreadable files and missing prompt columns.
    """
    if not script_args.dataset_name:
        raise RecipeError("dataset_name is not set; give a Hub dataset id, a prompt file or a folder.")
    test_split = script_args.dataset_test_split
    if test_split is not None and test_split.strip().lower() in _NO_SPLIT:
        test_split = None

    name = script_args.dataset_name
    train = _load(name, script_args.dataset_config, script_args.dataset_train_split, "train")
    train = _finish(train, script_args, "train", name, script_args.max_train_samples)

    eval_ds = None
    if script_args.eval_dataset_name:
        eval_name = script_args.eval_dataset_name
        eval_ds = _load(eval_name, script_args.dataset_config, test_split or "test", "eval")
        if eval_ds is None:
            raise RecipeError(f"eval_dataset_name={eval_name!r} has no '{test_split or 'test'}' split or file.")
    elif test_split is not None and not (looks_local(name) and Path(name).expanduser().is_file()):
        eval_name = name
        eval_ds = _load(name, script_args.dataset_config, test_split, "eval")
    if eval_ds is not None:
        eval_ds = _finish(eval_ds, script_args, "eval", eval_name, script_args.max_eval_samples)
    return train, eval_ds


__all__ = ["PROMPT_FILE_SUFFIXES", "load_prompt_dataset", "read_prompt_file"]
