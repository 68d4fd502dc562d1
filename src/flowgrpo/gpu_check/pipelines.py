"""Random-weight SD3.5-Medium-architecture pipelines saved to local folders, built on the GPU (nothing downloaded).

Two kinds, both with the small local tokenizers of :mod:`flowgrpo.testing` and random weights:

* ``sd35m-full`` (about 16 GB on disk): every component at full size, exactly the ``sd35m-random`` benchmark preset:
  the 2.2 B-parameter transformer, the SD3 VAE, CLIP-L, CLIP-G and the 4.7 B T5-XXL. The 24 GB memory check needs it: the
  text encoders are what ``offload_text_encoders`` moves, and T5-XXL alone is 9.5 GB in bf16.
* ``sd35m-launch`` (about 5.6 GB): the transformer and the VAE at full size, the text encoders at their real widths
  (so every embedding has the real shape: 333 tokens x 4096, pooled 2048) but with one layer each. The launch
  checks test what distribution does to the trained part: every sharded, wrapped, gathered and saved tensor is
  the transformer's, at full size. Full-depth encoders would only add load time and host memory: each launched
  process reads the whole folder, and eight processes each holding a 16 GB pipeline would fill the host's RAM.

Folders are built in a staging folder next to the target and renamed into place, with ``flowgrpo_build.json``
naming the kind; an existing folder of the same kind is reused. ``python -m flowgrpo.gpu_check.pipelines --kind
KIND --output DIR`` builds one (the checks run it as a subprocess, so their own processes never hold the memory
of the build).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["BUILD_FILE", "PIPELINE_KINDS", "PIPELINE_SIZES_GB", "build_sd35m_pipeline", "ensure_pipeline", "main", "save_atomically"]

PIPELINE_KINDS = {
    "sd35m-full": "SD3.5-Medium architecture at full size (transformer 2.2 B, VAE, CLIP-L, CLIP-G, T5-XXL 4.7 B)",
    "sd35m-launch": "SD3.5-Medium transformer (2.2 B) and VAE at full size; CLIP-L, CLIP-G and T5-XXL at their real "
                    "widths with one layer each",
}
#: disk each kind takes once saved (bf16 safetensors), checked before building
PIPELINE_SIZES_GB = {"sd35m-full": 16.0, "sd35m-launch": 6.0}
BUILD_FILE = "flowgrpo_build.json"
_BUILD_REVISION = 1


@contextlib.contextmanager
def _building(device: str, seed: int) -> Iterator[None]:
    import torch

    default_dtype = torch.get_default_dtype()
    devices = [torch.cuda.current_device()] if device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                yield
        finally:
            torch.set_default_dtype(default_dtype)


def _one_layer_encoders(device: str, seed: int) -> dict[str, Any]:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from ..benchmarking.presets import CLIP_G_FULL, CLIP_L_FULL, T5_XXL_FULL
    from ..testing.tiny_tokenizers import build_clip_tokenizer, build_t5_tokenizer

    clip_tok, clip_g_tok, t5_tok = build_clip_tokenizer(), build_clip_tokenizer(pad_token="!"), build_t5_tokenizer()

    def clip(arch: dict, tok) -> Any:
        arch = {**arch, "num_hidden_layers": 1}
        vocab = max(int(arch.pop("vocab_size")), len(tok))
        return CLIPTextModelWithProjection(CLIPTextConfig(vocab_size=vocab, bos_token_id=tok.bos_token_id,
                                                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                                          **arch))

    t5_arch = {**T5_XXL_FULL, "num_layers": 1}
    t5_vocab = max(int(t5_arch.pop("vocab_size")), len(t5_tok))
    with _building(device, seed + 1):
        encoders = {
            "text_encoder": clip(CLIP_L_FULL, clip_tok),
            "text_encoder_2": clip(CLIP_G_FULL, clip_g_tok),
            "text_encoder_3": T5EncoderModel(T5Config(vocab_size=t5_vocab, pad_token_id=t5_tok.pad_token_id,
                                                      eos_token_id=t5_tok.eos_token_id,
                                                      decoder_start_token_id=t5_tok.pad_token_id, **t5_arch)),
        }
    return {**{k: v.eval() for k, v in encoders.items()}, "tokenizer": clip_tok, "tokenizer_2": clip_g_tok,
            "tokenizer_3": t5_tok}


def build_sd35m_pipeline(kind: str = "sd35m-full", device: str = "cuda", seed: int = 0) -> Any:
    """The pipeline of ``kind`` (see the module docstring), in bf16, built directly on ``device``."""
    if kind not in PIPELINE_KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {', '.join(PIPELINE_KINDS)}.")
    from ..benchmarking.presets import SD3_SCHEDULER, SD35M_TRANSFORMER, VAE_FULL, build_preset_pipeline, get_preset

    if kind == "sd35m-full":
        return build_preset_pipeline(get_preset("sd35m-random"), seed=seed)
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    with _building(device, seed):
        transformer = SD3Transformer2DModel(**SD35M_TRANSFORMER).eval()
        vae = AutoencoderKL(**VAE_FULL, scaling_factor=1.5305, shift_factor=0.0609).eval()
    return StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER), transformer=transformer,
                                    vae=vae, **_one_layer_encoders(device, seed))


def _is_built(path: Path, kind: str) -> bool:
    try:
        info = json.loads((path / BUILD_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (path / "model_index.json").is_file() and info.get("kind") == kind and \
        info.get("revision") == _BUILD_REVISION


def save_atomically(pipeline: Any, path: str | os.PathLike, info: dict[str, Any]) -> Path:
    """``save_pretrained`` into a staging folder next to ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        pipeline.save_pretrained(staging / "pipeline")
        (staging / "pipeline" / BUILD_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging / "pipeline", path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def ensure_pipeline(kind: str, path: str | os.PathLike, *, python: str | None = None, seed: int = 0,
                    log=print) -> Path:
    """The folder of ``kind`` at ``path``, built first (in a subprocess, on the GPU) when missing."""
    path = Path(path)
    if _is_built(path, kind):
        log(f"[gpu-check] reusing {kind} pipeline in {path}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(path.parent).free / 1e9
    if free_gb < PIPELINE_SIZES_GB[kind] + 2:
        raise RuntimeError(f"Building the {kind} pipeline needs about {PIPELINE_SIZES_GB[kind]:.0f} GB of disk, but "
                           f"{path.parent} has {free_gb:.1f} GB free; free some space (e.g. remove old "
                           "outputs/gpu_check/checks/*/run folders) or give --output a larger disk.")
    log(f"[gpu-check] building the {kind} pipeline in {path}: {PIPELINE_KINDS[kind]}")
    tic = time.monotonic()
    subprocess.run([python or sys.executable, "-m", "flowgrpo.gpu_check.pipelines", "--kind", kind, "--output",
                    str(path), "--seed", str(seed)], check=True)
    if not _is_built(path, kind):
        raise RuntimeError(f"building the {kind} pipeline did not leave a pipeline in {path}")
    log(f"[gpu-check] built {kind} in {time.monotonic() - tic:.0f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a random-weight SD3.5-Medium-architecture pipeline folder.")
    parser.add_argument("--kind", choices=sorted(PIPELINE_KINDS), required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda (default); meta/cpu only for inspecting the build")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: building the full-size pipelines needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    tic = time.monotonic()
    pipe = build_sd35m_pipeline(args.kind, device=args.device, seed=args.seed)
    params = {name: sum(p.numel() for p in module.parameters()) for name, module in pipe.components.items()
              if isinstance(module, torch.nn.Module)}
    built = time.monotonic() - tic
    save_atomically(pipe, args.output, {"kind": args.kind, "revision": _BUILD_REVISION, "seed": args.seed,
                                        "parameters": params, "description": PIPELINE_KINDS[args.kind]})
    print(f"built {args.kind} in {built:.0f} s, saved in {time.monotonic() - tic - built:.0f} s to {args.output}; "
          f"parameters: {params}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
