"""The GPUs a plan can target: memory, peak dense bf16 throughput, memory bandwidth and interconnect.

Figures are the vendors' datasheet numbers for dense (not 2:4-sparse) bf16 tensor-core math, the HBM/GDDR bandwidth and
the per-GPU bandwidth of the link that carries collectives (NVLink for the SXM parts, PCIe 4.0 x16 for the cards
without NVLink in multi-GPU boxes). ``memory_gb`` is the nominal capacity in GB (10^9 bytes); the CUDA context and the allocator's slack are the plan's
``overhead`` term, not deducted here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPU:
    """One accelerator model."""

    name: str
    memory_gb: float          # device memory, 10^9 bytes
    bf16_tflops: float        # peak dense bf16 tensor-core throughput, 10^12 FLOP/s
    bandwidth_gbs: float      # device memory bandwidth, GB/s
    interconnect_gbs: float   # per-GPU bandwidth of the collective link (one direction), GB/s
    interconnect: str

    def to_dict(self) -> dict:
        return asdict(self)


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80gb", 80, 989.4, 3350, 450, "NVLink 4 (900 GB/s bidirectional)"),
    GPU("h800-80gb", 80, 989.4, 3350, 200, "NVLink (400 GB/s bidirectional, export variant)"),
    GPU("h200-141gb", 141, 989.4, 4800, 450, "NVLink 4 (900 GB/s bidirectional)"),
    GPU("b200-180gb", 180, 2250, 8000, 900, "NVLink 5 (1.8 TB/s bidirectional)"),
    GPU("a100-80gb", 80, 312, 2039, 300, "NVLink 3 (600 GB/s bidirectional)"),
    GPU("a100-40gb", 40, 312, 1555, 300, "NVLink 3 (600 GB/s bidirectional)"),
    GPU("l40s-48gb", 48, 362.05, 864, 32, "PCIe 4.0 x16"),
    GPU("rtx4090-24gb", 24, 165.2, 1008, 32, "PCIe 4.0 x16"),
    GPU("rtx3090-24gb", 24, 35.6, 936, 32, "PCIe 4.0 x16 (NVLink bridge: 56 GB/s)"),
)}

DEFAULT_GPU = "h100-80gb"


def get_gpu(name: str) -> GPU:
    """The table's entry for ``name`` (case-insensitive); an unknown name lists the valid ones."""
    key = name.strip().lower()
    if key not in GPUS:
        import difflib

        close = difflib.get_close_matches(key, list(GPUS), n=2, cutoff=0.5)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ValueError(f"--gpu {name!r} is not in the GPU table{hint}; choose one of {', '.join(GPUS)}.")
    return GPUS[key]


__all__ = ["DEFAULT_GPU", "GPU", "GPUS", "get_gpu"]
