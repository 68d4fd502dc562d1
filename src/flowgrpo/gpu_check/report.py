"""The run's report: ``report.json`` (everything), ``report.md`` (for people) and rows for ``docs/benchmarks.md``.

Both files are rewritten after every check, so an interrupted run still leaves the results of the checks that
finished. ``report.md`` holds one table line per check (status, wall time, time limit, peak GPU memory, key
figures), then each check's failures, figures and last lines of output, then the rows to paste into
docs/benchmarks.md: the "Results" table's format for every ``bench/<preset>`` check, and the "GPU checks" table's
format for every check. :func:`update_benchmarks_doc` puts them in place (``--update-docs``), replacing the
"not yet measured" placeholder of the same preset or check.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .runner import CheckResult

__all__ = ["BENCH_TABLE_HEADER", "CHECK_TABLE_HEADER", "benchmark_row", "check_row", "git_commit", "machine_info",
           "machine_label", "update_benchmarks_doc", "write_report"]

BENCH_TABLE_HEADER = ("| date | machine | commit | preset | steps | step_time_s | images/s | peak MB | floor_time_s | "
                      "overhead_ratio (per-step range) | TFLOP/step | achieved GFLOP/s (step / floor) |")
CHECK_TABLE_HEADER = "| date | machine | commit | check | status | wall s | peak GPU MiB | figures |"


def _num(value: float | None, digits: int = 3) -> str:
    """``digits`` significant digits, never in exponent notation ("-" for a missing value)."""
    if value is None:
        return "-"
    value = float(value)
    if abs(value) >= 10**digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def git_commit(repo: str | os.PathLike) -> str:
    """The checked-out commit (short), with ``+dirty`` when tracked files differ from it; ``-`` without git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"
    return f"{sha}+dirty" if dirty else sha


def _nvidia_smi_gpus() -> list[dict[str, Any]] | None:
    """The GPUs ``nvidia-smi`` lists (restricted to ``CUDA_VISIBLE_DEVICES`` when it holds indices)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory_mib": float(parts[2]), "driver": parts[3]})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        keep = [int(v) for v in visible.split(",") if v.strip()]
        gpus = [g for i in keep for g in gpus if g["index"] == i]
    return gpus


def machine_info() -> dict[str, Any]:
    """GPUs (from ``nvidia-smi``, so that this process never creates a CUDA context that would hold GPU memory
    while the checks measure theirs), driver, library versions and host."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "gpus": []}
    gpus = _nvidia_smi_gpus()
    if gpus is not None:
        info["gpus"] = [{k: v for k, v in g.items() if k != "driver"} for g in gpus]
        info["driver"] = gpus[0]["driver"] if gpus else None
    else:
        info["driver"] = None
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["visible_gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as err:  # a machine without torch or with a broken driver still gets a report
        info["torch_error"] = f"{type(err).__name__}: {err}"
    from importlib.metadata import PackageNotFoundError, version

    info["versions"] = {}
    for module in ("diffusers", "transformers", "accelerate", "peft", "deepspeed", "bitsandbytes"):
        try:
            info["versions"][module] = version(module)
        except PackageNotFoundError:
            info["versions"][module] = None
    return info


def machine_label(machine: Mapping[str, Any]) -> str:
    """``"1x NVIDIA H100 80GB HBM3"`` (or ``"2x A, 1x B"``); ``"no GPU"``."""
    names: dict[str, int] = {}
    for gpu in machine.get("gpus") or []:
        names[gpu["name"]] = names.get(gpu["name"], 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in names.items()) or "no GPU"


def benchmark_row(bench: Mapping[str, Any], *, date: str, machine: str, commit: str) -> str:
    """One row of docs/benchmarks.md's "Results" table from a ``scripts/benchmark.py --json`` result."""
    kind = {"cuda_max_allocated": "CUDA allocated", "rss": "RSS"}.get(bench.get("peak_memory_kind", ""),
                                                                      bench.get("peak_memory_kind", ""))
    per_step = bench.get("overhead_ratio_per_step") or []
    ratio = "-"
    if bench.get("overhead_ratio") is not None:
        ratio = _num(bench["overhead_ratio"], 4)
        if per_step:
            ratio += f" ({_num(min(per_step), 3)}-{_num(max(per_step), 3)})"
    flops = bench.get("flops") or {}
    tflop = _num(flops["total"] / 1e12, 3) if flops.get("total") else "-"
    achieved = "-"
    if bench.get("achieved_flops_per_s") and bench.get("floor_flops_per_s"):
        achieved = f"{_num(bench['achieved_flops_per_s'] / 1e9)} / {_num(bench['floor_flops_per_s'] / 1e9)}"
    cells = [
        date, machine, commit, f"`{bench.get('preset', '?')}`",
        f"{bench.get('steps', '?')} (+{bench.get('warmup_steps', 0)} warm-up)",
        _num(bench.get("step_time_s"), 4), _num(bench.get("images_per_s"), 3),
        f"{_num(bench.get('peak_memory_mb'), 4)} ({kind})", _num(bench.get("floor_time_s"), 4), ratio, tflop,
        achieved,
    ]
    return "| " + " | ".join(cells) + " |"


def _peak_gpu_mib(result: CheckResult) -> float | None:
    peak = result.peak_memory or {}
    if peak.get("torch_max_reserved_mib"):
        return float(peak["torch_max_reserved_mib"])
    smi = peak.get("nvidia_smi") or {}
    values = [v for v in (smi.get("peak_mib") or {}).values()]
    return max(values) if values else None


def check_row(result: CheckResult, *, date: str, machine: str, commit: str) -> str:
    """One row of docs/benchmarks.md's "GPU checks" table."""
    figures = (result.summary or "; ".join(result.failures[:1]) or "-").replace("|", "/").replace("\n", " ")
    cells = [date, machine, commit, f"`{result.name}`", result.status.replace("_", " "), _num(result.wall_s, 4),
             _num(_peak_gpu_mib(result), 5), figures]
    return "| " + " | ".join(cells) + " |"


def _bench_summary(bench: Mapping[str, Any]) -> str:
    parts = [f"step {_num(bench.get('step_time_s'), 4)} s", f"{_num(bench.get('images_per_s'), 3)} images/s"]
    if bench.get("overhead_ratio") is not None:
        parts.append(f"overhead ratio {_num(bench['overhead_ratio'], 4)}")
    return ", ".join(parts)


def _fill_bench_summaries(results: Sequence[CheckResult]) -> None:
    for r in results:
        bench = r.metrics.get("benchmark")
        if isinstance(bench, Mapping) and not r.summary:
            r.summary = _bench_summary(bench)


def _peak_text(result: CheckResult) -> str:
    peak = result.peak_memory or {}
    alloc, reserved = peak.get("torch_max_allocated_mib"), peak.get("torch_max_reserved_mib")
    smi = [v for v in ((peak.get("nvidia_smi") or {}).get("peak_mib") or {}).values()]
    return f"{_num(alloc, 5)} / {_num(reserved, 5)} / {_num(max(smi) if smi else None, 5)}"


def write_report(results: Sequence[CheckResult], output_dir: str | os.PathLike, *, machine: Mapping[str, Any],
                 commit: str, command: Sequence[str], pending: Sequence[str] = (), started_at: str | None = None,
                 finished: bool = True) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``output_dir``; returns their paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _fill_bench_summaries(results)
    now = datetime.now(timezone.utc)
    date = now.strftime("%Y-%m-%d")
    label = machine_label(machine)
    counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "timed_out")}
    all_passed = finished and not pending and bool(results) and counts["passed"] == len(results)
    bench_rows = {r.metrics["benchmark"].get("preset", r.name): benchmark_row(r.metrics["benchmark"], date=date,
                                                                              machine=label, commit=commit)
                  for r in results if isinstance(r.metrics.get("benchmark"), Mapping)}
    check_rows = {r.name: check_row(r, date=date, machine=label, commit=commit) for r in results}
    data = {
        "started_at": started_at, "written_at": now.isoformat(timespec="seconds"), "finished": finished,
        "passed": all_passed, "counts": counts, "pending": list(pending), "commit": commit, "command": list(command),
        "machine": dict(machine), "checks": [r.to_dict() for r in results],
        "docs_rows": {"results": bench_rows, "gpu_checks": check_rows},
    }
    json_path = out / "report.json"
    tmp = out / ".report.json.tmp"
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, json_path)

    lines = [f"# GPU check report ({date})", "",
             f"Machine: {label}; driver {machine.get('driver') or '?'}, torch {machine.get('torch', '?')} "
             f"(CUDA {machine.get('cuda') or '?'}), {machine.get('cpu_count', '?')} CPU cores. Commit {commit}.",
             f"Command: `{' '.join(command)}`", ""]
    state = "all passed" if all_passed else ("still running" if not finished else "NOT all passed")
    lines.append(f"**{counts['passed']} of {len(results)} checks passed ({state})**; failed: {counts['failed']}, "
                 f"timed out: {counts['timed_out']}" + (f"; not run yet: {', '.join(pending)}" if pending else "") + ".")
    lines += ["", "| check | status | wall s | limit s | peak GPU MiB (torch allocated / reserved / nvidia-smi) | "
                  "figures |", "|---|---|---|---|---|---|"]
    for r in results:
        figures = (r.summary or "; ".join(r.failures[:1]) or "-").replace("|", "/").replace("\n", " ")
        lines.append(f"| `{r.name}` | {r.status.replace('_', ' ')} | {_num(r.wall_s, 4)} | {r.timeout_s:.0f} | "
                     f"{_peak_text(r)} | {figures} |")
    for name in pending:
        lines.append(f"| `{name}` | not run yet | | | | |")
    lines += ["", "## Checks", ""]
    for r in results:
        lines += [f"### `{r.name}`: {r.status.replace('_', ' ')}", "", r.description, "",
                  f"- command: `{' '.join(r.command)}`", f"- log: `{r.log}` (exit status {r.returncode})"]
        lines += [f"- failure: {f}" for f in r.failures]
        lines += [f"- note: {n}" for n in r.notes]
        metrics = {k: v for k, v in r.metrics.items() if k != "benchmark"}
        if metrics:
            lines += ["", "```json", json.dumps(metrics, indent=2, default=str)[:6000], "```"]
        if r.output_tail:
            lines += ["", "Last lines of output:", "", "```", r.output_tail, "```"]
        lines.append("")
    lines += ["## Rows for docs/benchmarks.md", "",
              "Results table (`python scripts/gpu_check.py ... --update-docs` puts them in place):", "",
              BENCH_TABLE_HEADER]
    lines += list(bench_rows.values()) or ["(no benchmark ran)"]
    lines += ["", "GPU checks table:", "", CHECK_TABLE_HEADER] + list(check_rows.values())
    md_path = out / "report.md"
    tmp = out / ".report.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, md_path)
    return md_path, json_path


def _place_rows(lines: list[str], header: str, rows: Mapping[str, str]) -> list[str]:
    """Put each row into the table that starts with ``header``: over the placeholder row that names the same key and
    says "not yet measured", else after the table's last row."""
    head = header.split(" |")[:4]
    start = next((i for i, ln in enumerate(lines) if ln.split(" |")[:4] == head), None)
    if start is None:
        raise ValueError(f"No table with the header {header!r} in the document; add it first.")
    end = start + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    for key, row in rows.items():
        placeholder = next((i for i in range(start + 2, end) if f"`{key}`" in lines[i]
                            and "not yet measured" in lines[i]), None)
        if placeholder is not None:
            lines[placeholder] = row
        else:
            lines.insert(end, row)
            end += 1
    return lines


def update_benchmarks_doc(path: str | os.PathLike, bench_rows: Mapping[str, str],
                          check_rows: Mapping[str, str]) -> Path:
    """Write the measured rows into docs/benchmarks.md's "Results" and "GPU checks" tables."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    if bench_rows:
        lines = _place_rows(lines, BENCH_TABLE_HEADER, bench_rows)
    if check_rows:
        lines = _place_rows(lines, CHECK_TABLE_HEADER, check_rows)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
