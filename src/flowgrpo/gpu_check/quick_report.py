"""The quick GPU check's report: ``gpu_report.json`` (everything), ``gpu_report.md`` (for people), the checks' logs.

``gpu_report.json`` holds the machine (GPU, driver, torch and CUDA versions, the library versions found), the date,
the commit, the command, the budget and the time the set-up took, the recipe overrides, every check's full result
(:class:`~flowgrpo.gpu_check.runner.CheckResult`: status, wall time, limit, peak GPU memory, the figures it wrote,
its failures and last lines of output), and the rows for docs/benchmarks.md. ``gpu_report.md`` is rendered from
that dictionary alone (:func:`render_markdown`), so a report can be rendered again from a recorded JSON.
``gpu_quick_logs.txt`` is every check's whole output, each cut to its last :data:`LOG_BYTES_PER_CHECK`.

The three files are all that is written into the output folder (a GPU machine returns at most 8 files of 16 MiB).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .runner import CheckResult

__all__ = ["LOG_BYTES_PER_CHECK", "LOGS_FILE", "MD_FILE", "JSON_FILE", "QUICK_TABLE_HEADER", "machine_section",
           "render_markdown", "step_row", "write_quick_report"]

JSON_FILE = "gpu_report.json"
MD_FILE = "gpu_report.md"
LOGS_FILE = "gpu_quick_logs.txt"
LOG_BYTES_PER_CHECK = 1024 * 1024
#: docs/benchmarks.md's table of quick-check figures ("The 15-minute GPU check")
QUICK_TABLE_HEADER = ("| date | machine | commit | step | s/step measured (planned) | images/s | peak allocated GiB "
                      "measured (planned) | encode / sampling / decode* / reward wait s | forward / backward / "
                      "optimizer s | step-1 max abs(ratio-1), KL |")
PHASES = (("text_encoding", "encode"), ("rollout", "sampling"), ("vae_decode", "decode"), ("reward", "reward wait"),
          ("training_forward", "forward"), ("training_backward", "backward"), ("optimizer", "optimizer"),
          ("other", "other"))
STEP_CHECKS = ("sd35m_step", "nft_step")


def _num(value: Any, digits: int = 3) -> str:
    if value is None or value == "":
        return "-"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        return f"{value:.{digits - 1}e}"
    if abs(value) >= 10**digits:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def machine_section(gpu: str = "auto") -> dict[str, Any]:
    """The machine: :func:`~flowgrpo.gpu_check.report.machine_info` (nvidia-smi, torch, CUDA; no CUDA context is
    made), its label, the ``flowgrpo plan`` GPU table entry it matches, and the versions of the libraries the checks
    use (from wherever they are importable: the image or the carried wheels)."""
    from importlib.metadata import PackageNotFoundError, version

    from .report import machine_info, machine_label
    from .step_plan import gpu_table_entry

    info = machine_info()
    info["label"] = machine_label(info)
    gpus = info.get("gpus") or []
    info["gpu_kind"] = None
    if gpu != "auto":
        info["gpu_kind"] = gpu
    elif gpus:
        try:
            info["gpu_kind"] = gpu_table_entry(gpus[0]["name"], gpus[0].get("memory_mib"))
        except ValueError as err:
            info["gpu_kind_error"] = str(err)
    for name in ("diffusers", "datasets", "transformers", "accelerate", "peft", "huggingface-hub", "safetensors",
                 "numpy", "pyarrow", "fsspec"):
        try:
            info["versions"][name] = version(name)
        except PackageNotFoundError:
            info["versions"][name] = None
    return info


def _metrics(check: Mapping[str, Any]) -> Mapping[str, Any]:
    return check.get("metrics") or {}


def step_row(check: Mapping[str, Any], plan: Mapping[str, Any] | None, *, date: str, machine: str,
             commit: str) -> str | None:
    """The docs/benchmarks.md row (:data:`QUICK_TABLE_HEADER`) of a timed step check; ``None`` when no step was
    timed."""
    m = _metrics(check)
    bench = m.get("benchmark") or {}
    if not bench.get("step_time_s"):
        return None
    b = bench.get("breakdown") or {}
    settings = m.get("settings") or {}
    cmp = (plan or {}).get("comparison") or {}
    planned_s = (cmp.get("time") or {}).get("planned_step_s")
    planned_gib = (cmp.get("memory") or {}).get("planned_allocated_gib")
    alloc = (m.get("peak_memory") or {}).get("max_memory_allocated_mib")
    first = m.get("first_step") or {}
    overrides = " ".join(m.get("overrides") or [])
    name = f"`{m.get('recipe', check['name'])}`" + (f" {overrides}" if overrides else "")
    name += f" ({settings.get('images_per_step', '?')} images)"
    cells = [date, machine, commit, name,
             f"{_num(bench['step_time_s'], 4)} ({_num(planned_s, 3)})", _num(bench.get("images_per_s")),
             f"{_num(alloc / 1024 if alloc else None)} ({_num(planned_gib)})",
             " / ".join(_num(b.get(k)) for k in ("text_encoding", "rollout", "vae_decode", "reward")),
             " / ".join(_num(b.get(k)) for k in ("training_forward", "training_backward", "optimizer")),
             f"{_num(first.get('on_policy_ratio_max_dev'))}, {_num(first.get('kl'))}" if first else "-"]
    return "| " + " | ".join(cells) + " |"


def _check_line(check: Mapping[str, Any]) -> str:
    peak = check.get("peak_memory") or {}
    smi = [v for v in ((peak.get("nvidia_smi") or {}).get("peak_mib") or {}).values()]
    base = [v for v in ((peak.get("nvidia_smi") or {}).get("baseline_mib") or {}).values()]
    gpu = (f"{_num(peak.get('torch_max_allocated_mib'), 5)} / {_num(peak.get('torch_max_reserved_mib'), 5)} / "
           f"{_num(max(smi) - (min(base) if base else 0) if smi else None, 5)}")
    figures = (check.get("summary") or "; ".join((check.get("failures") or [])[:1])
               or "; ".join(check.get("notes") or []) or "-")
    return (f"| `{check['name']}` | {check['status'].replace('_', ' ')} | {_num(check.get('wall_s'), 4)} | "
            f"{_num(check.get('timeout_s'), 4)} | {gpu} | {figures.replace('|', '/').replace(chr(10), ' ')} |")


def _step_section(check: Mapping[str, Any], plan: Mapping[str, Any] | None) -> list[str]:
    m = _metrics(check)
    bench = m.get("benchmark") or {}
    settings = m.get("settings") or {}
    lines = []
    if settings:
        shown = ", ".join(f"{k} {v}" for k, v in settings.items() if v is not None)
        lines += [f"Settings (one GPU's share): {shown}.", ""]
    if m.get("overrides"):
        lines += [f"Recipe overrides: `{' '.join(m['overrides'])}`.", ""]
    if "pipeline_build_s" in m:
        lines.append(f"Random-weight pipeline built in {_num(m['pipeline_build_s'])} s; the check ran "
                     f"{_num(m.get('wall_s'))} s.")
    records = m.get("step_records") or []
    if records:
        lines += ["", "| step | s | " + " | ".join(label for _, label in PHASES) + " | max allocated GiB |",
                  "|---|---|" + "---|" * len(PHASES) + "---|"]
        for r in records:
            b = r.get("breakdown") or {}
            alloc = r.get("max_memory_allocated_mib")
            lines.append(f"| {r.get('step')} | {_num(r.get('step_time_s'), 4)} | "
                         + " | ".join(_num(b.get(key)) for key, _ in PHASES)
                         + f" | {_num(alloc / 1024 if alloc else None)} |")
        lines.append("")
        lines.append(f"The first step is the warm-up ({m.get('warmup_steps', 1)}); decode runs in the background "
                     "(its time, and the reward's, are beside the step, not in it).")
    if bench.get("step_time_s"):
        ov = bench.get("overlapped") or {}
        peaks = m.get("peak_memory") or {}
        lines += ["", f"**Median of the {len(bench.get('step_times_s') or [])} timed steps: "
                      f"{_num(bench['step_time_s'], 4)} s a step, {_num(bench.get('images_per_s'))} images/s**; in the "
                      f"background: decode {_num(ov.get('vae_decode_s'))} s, reward {_num(ov.get('reward_compute_s'))} s."
                      f" Peak memory: {_num((peaks.get('max_memory_allocated_mib') or 0) / 1024 or None)} GiB "
                      f"allocated, {_num((peaks.get('max_memory_reserved_mib') or 0) / 1024 or None)} GiB reserved."]
    elif records:
        lines += ["", "**Partial**: the check stopped before its timed steps finished; the rows above are what it "
                      "finished."]
    first = m.get("first_step") or {}
    if first:
        lines += ["", f"Step 1 at full size (bf16): max |ratio - 1| {_num(first.get('on_policy_ratio_max_dev'))}, "
                      f"ratio mean {_num(first.get('ratio_mean'), 6)}, KL {_num(first.get('kl'))}."]
    lines += _passes_section(m.get("timesteps_per_pass") or {})
    return lines


def _passes_section(passes: Mapping[str, Any]) -> list[str]:
    """The training phase at train_timesteps_per_pass 1 against all (`recipe_step.compare_timesteps_per_pass`)."""
    arms = passes.get("arms") or {}
    if not arms:
        return []
    lines = ["", f"Training phase of one more generation ({passes.get('micro_batches')} micro-batches, "
                 f"{passes.get('trained_timesteps')} trained timesteps each; no optimizer step), by "
                 "`train_timesteps_per_pass`:", "",
             "| train_timesteps_per_pass | passes a micro-batch | forward + backward s | peak allocated GiB | "
             "first-pass max abs(ratio - 1) |", "|---|---|---|---|---|"]
    for setting, arm in arms.items():
        peak = arm.get("peak_allocated_mib")
        times = arm.get("training_s") or []
        lines.append(f"| {setting} | {arm.get('passes_per_micro_batch', '-')} | "
                     f"{' / '.join(_num(t, 4) for t in times) or '-'} | {_num(peak / 1024 if peak else None)} | "
                     f"{_num(arm.get('on_policy_ratio_max_dev'))} |")
    if passes.get("speedup"):
        lines += ["", f"K = all takes {_num(1 / passes['speedup'], 3)} of the time of K = 1 "
                      f"({_num(passes['speedup'], 3)}x faster)."]
    return lines


def _compile_section(check: Mapping[str, Any], uncompiled: Mapping[str, Any] | None) -> list[str]:
    """The compiled step's rows, its compile time, and against ``sd35m_step`` (same recipe and overrides, in the
    same call) the first and the steady step as ratios."""
    lines = _step_section(check, None)
    m = _metrics(check)
    first = m.get("first_step") or {}
    records = m.get("step_records") or []
    if "timing/compile_s" in first:
        lines += ["", f"Compiling the blocks took {_num(first['timing/compile_s'], 4)} s of step 1 "
                      f"({_num(first.get('compile/graphs'))} graphs; "
                      f"{_num(first.get('compile/recompiles', 0))} compiled after step 1)."]
    base = _metrics(uncompiled or {})
    base_records = base.get("step_records") or []
    steady = (m.get("benchmark") or {}).get("step_time_s")
    base_steady = (base.get("benchmark") or {}).get("step_time_s")
    if records and base_records:
        lines += ["", "| | compile off (`sd35m_step`) | compile on | on / off |", "|---|---|---|---|",
                  f"| first step, s | {_num(base_records[0].get('step_time_s'), 4)} | "
                  f"{_num(records[0].get('step_time_s'), 4)} | "
                  f"{_num(_ratio(records[0].get('step_time_s'), base_records[0].get('step_time_s')))} |",
                  f"| steady step, s (median of the timed steps) | {_num(base_steady, 4)} | {_num(steady, 4)} | "
                  f"{_num(_ratio(steady, base_steady))} |"]
    return lines


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _plan_section(check: Mapping[str, Any]) -> list[str]:
    cmp = _metrics(check).get("comparison") or {}
    if not cmp:
        return []
    mem, tm = cmp.get("memory") or {}, cmp.get("time") or {}
    return ["| | planned | measured | measured / planned |", "|---|---|---|---|",
            f"| peak memory, GiB (planned without its overhead allowance; measured max_memory_allocated) | "
            f"{_num(mem.get('planned_allocated_gib'))} | {_num(mem.get('measured_allocated_gib'))} | "
            f"{_num(mem.get('allocated_ratio'))} |",
            f"| peak memory, GiB (planned with it; measured max_memory_reserved) | {_num(mem.get('planned_peak_gib'))} "
            f"| {_num(mem.get('measured_reserved_gib'))} | {_num(mem.get('reserved_ratio'))} |",
            f"| step time, s (planned at MFU {_num(cmp.get('mfu_assumed'))}) | {_num(tm.get('planned_step_s'))} | "
            f"{_num(tm.get('measured_step_s'))} | {_num(tm.get('ratio'))} |",
            "",
            f"GPU table entry {cmp.get('gpu')}; the step's {_num(cmp.get('step_flops'))} FLOPs in the measured time: "
            f"{_num(tm.get('achieved_tflops'))} TFLOP/s, an MFU of {_num(tm.get('implied_mfu'), 2)}. Planned phases "
            f"(GB): {cmp.get('planned_phases_gb')}; terms: {cmp.get('planned_breakdown_gb')}."]


def _bf16_section(check: Mapping[str, Any], step: Mapping[str, Any] | None) -> list[str]:
    m = _metrics(check)
    lines = []
    models = m.get("models") or {}
    if models:
        lines += ["| run | guidance | CFG | max abs(ratio - 1) | ratio mean | KL | peak MiB |", "|---|---|---|---|---|---|---|"]
        for name, r in models.items():
            if "error" in r:
                lines.append(f"| {name} | | | {r['error']} | | | |")
                continue
            lines.append(f"| {name} | {_num(r.get('guidance_scale'))} | {r.get('cfg')} | "
                         f"{_num(r.get('on_policy_ratio_max_dev'))} | {_num(r.get('ratio_mean'), 6)} | "
                         f"{_num(r.get('kl'))} | {_num(r.get('peak_allocated_mib'), 5)} |")
        lines += ["", f"Tolerance {m.get('tolerance')}; the tightest of 0, 1e-7, ..., 1e-1 that held: "
                      f"{m.get('tolerance_held')}."]
    first = _metrics(step or {}).get("first_step") or {}
    if first:
        lines += ["", f"Full size, CFG as the recipe sets it (from `sd35m_step`'s first step): max |ratio - 1| "
                      f"{_num(first.get('on_policy_ratio_max_dev'))}, KL {_num(first.get('kl'))}."]
    return lines


def _wheels_section(check: Mapping[str, Any]) -> list[str]:
    wheels = _metrics(check).get("wheels") or {}
    if not wheels:
        return []
    lines = ["Carried: " + (", ".join(f"{k} {v}" for k, v in (wheels.get("carried") or {}).items()) or "nothing")
             + f" (installed into `{wheels.get('site')}`)."]
    imported = wheels.get("imported") or {}
    if imported:
        lines.append("Imported: " + ", ".join(f"{k} {v.get('version')}" for k, v in imported.items()) + ".")
    problems = wheels.get("problems") or []
    lines.append("Requirements (the carried wheels' and flowgrpo's setup.py): "
                 + ("all met." if not problems else "; ".join(problems)))
    if wheels.get("absent"):
        lines.append("Not installed (flowgrpo requires them, the quick check does not import them): "
                     + ", ".join(wheels["absent"]) + ".")
    flowgrpo = (wheels.get("requirements") or {}).get("flowgrpo") or {}
    if flowgrpo:
        lines.append("Found for flowgrpo's requirements: " + ", ".join(f"{k} -> {v}" for k, v in flowgrpo.items())
                     + ".")
    return lines


def _launch_section(check: Mapping[str, Any]) -> list[str]:
    m = _metrics(check)
    if not m:
        return []
    export = m.get("export") or {}
    return [f"Steps {m.get('global_step')} (logged {m.get('logged_steps')}); step-1 max |ratio - 1| "
            f"{_num(m.get('on_policy_ratio_max_dev'))}, KL {_num(m.get('kl'))}; the launch took "
            f"{_num(m.get('launch_wall_s'))} s; processes that recorded their memory: {m.get('ranks_recorded')}; "
            f"exported LoRA: {export.get('lora_layers_in_file')} layers, {export.get('nonzero_lora_B')} non-zero B."]


def render_markdown(data: Mapping[str, Any]) -> str:
    """``gpu_report.md`` from the ``gpu_report.json`` dictionary."""
    machine = data.get("machine") or {}
    versions = machine.get("versions") or {}
    budget = data.get("budget") or {}
    checks = {c["name"]: c for c in data.get("checks") or []}
    counts = data.get("counts") or {}
    title = "Quick GPU check" + (" (dry run)" if data.get("dry_run") else "")
    lines = [f"# {title}: {data.get('date')}, {machine.get('label', '?')}", "",
             f"Machine: {machine.get('label', '?')} (plan table entry {machine.get('gpu_kind') or '-'}), driver "
             f"{machine.get('driver') or '-'}, {machine.get('cpu_count', '?')} CPU cores, Python "
             f"{machine.get('python', '?')}; torch {machine.get('torch', '?')} (CUDA {machine.get('cuda') or '-'}); "
             + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + ".",
             f"Commit {data.get('commit')}; command `{data.get('command')}`.",
             f"Budget {_num(budget.get('budget_s'))} s: set-up {_num(data.get('setup_s'))} s (allowed "
             f"{_num(budget.get('shell_setup_s'))}), limits {budget.get('limits_s')}; the run took "
             f"{_num(data.get('elapsed_s'), 4)} s.", ""]
    state = "finished" if data.get("finished") else "still running"
    others = [f"{k.replace('_', ' ')}: {v}" for k, v in counts.items() if k != "passed" and v]
    if data.get("pending"):
        others.append(f"not run yet: {', '.join(data['pending'])}")
    lines.append(f"**{counts.get('passed', 0)} of {len(checks)} checks passed ({state})**"
                 + (f"; {', '.join(others)}" if others else "") + ".")
    if data.get("overrides"):
        lines.append(f"Recipe overrides for `sd35m_step` and its plan: `{' '.join(data['overrides'])}`.")
    lines += ["", "| check | status | wall s | limit s | peak GPU MiB (torch allocated / reserved / nvidia-smi above "
                  "idle) | figures |", "|---|---|---|---|---|---|"]
    lines += [_check_line(c) for c in checks.values()]
    sections = [
        ("setup/wheels", "Carried wheels", lambda c: _wheels_section(c)),
        ("bf16_onpolicy", "bf16 on-policy check (first pass: ratio 1, KL 0)",
         lambda c: _bf16_section(c, checks.get("sd35m_step"))),
        ("sd35m_step", "SD3.5-Medium, Flow-GRPO-Fast step of recipes/ocr.yaml",
         lambda c: _step_section(c, checks.get("plan_vs_measured"))),
        ("plan_vs_measured", "Planned (flowgrpo plan) against measured, the same step", _plan_section),
        ("nft_step", "SD3.5-Medium, DiffusionNFT step of recipes/nft_ocr.yaml", lambda c: _step_section(c, None)),
        ("launch/fsdp8", "accelerate launch with accelerate_configs/fsdp8.yaml", _launch_section),
        ("sd35m_compile", "SD3.5-Medium, the same step with torch_compile (compile off against on)",
         lambda c: _compile_section(c, checks.get("sd35m_step"))),
    ]
    for name, heading, render in sections:
        check = checks.get(name)
        if check is None:
            continue
        lines += ["", f"## {heading} (`{name}`: {check['status'].replace('_', ' ')})", ""]
        body = render(check) if check["status"] not in ("not_run", "skipped") else []
        lines += body or [f"No figures. {'; '.join(check.get('notes') or [])}".strip()]
        for failure in check.get("failures") or []:
            lines.append(f"- failure: {failure}")
    lines += ["", "## Rows for docs/benchmarks.md", "", QUICK_TABLE_HEADER,
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += list((data.get("docs_rows") or {}).values()) or ["(no step was timed)"]
    lines += ["", "## Last lines of each check's output", ""]
    for check in checks.values():
        if check.get("output_tail"):
            lines += [f"### `{check['name']}` (exit status {check.get('returncode')})", "", "```",
                      check["output_tail"], "```", ""]
    return "\n".join(lines) + "\n"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _logs(results: Sequence[CheckResult], setup_log: Path | None) -> str:
    parts = []
    sources = ([("set-up (scripts/gpu_quick.sh)", setup_log)] if setup_log else []) + \
              [(r.name, Path(r.log)) for r in results if r.log]
    for name, path in sources:
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - LOG_BYTES_PER_CHECK))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        cut = f" (last {LOG_BYTES_PER_CHECK} of {size} bytes)" if size > LOG_BYTES_PER_CHECK else ""
        parts.append(f"===== {name}{cut} =====\n{text}")
    return "\n".join(parts)


def write_quick_report(results: Sequence[CheckResult], output_dir: str | os.PathLike, *, machine: Mapping[str, Any],
                       commit: str, command: str, budget: Mapping[str, Any], overrides: Sequence[str] = (),
                       started_at: float | None = None, setup_s: float | None = None, pending: Sequence[str] = (),
                       finished: bool = True, dry_run: bool = False,
                       work: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write ``gpu_report.json``, ``gpu_report.md`` and ``gpu_quick_logs.txt`` into ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    checks = [r.to_dict() for r in results]
    by_name = {c["name"]: c for c in checks}
    counts: dict[str, int] = {}
    for c in checks:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    counts.setdefault("passed", 0)
    date = now.strftime("%Y-%m-%d")
    rows = {}
    for name in STEP_CHECKS:
        if name in by_name:
            row = step_row(by_name[name], by_name.get("plan_vs_measured") if name == "sd35m_step" else None,
                           date=date, machine=machine.get("label", "?"), commit=commit)
            if row:
                rows[name] = row
    data = {
        "report": "flowgrpo quick GPU check", "date": date, "written_at": now.isoformat(timespec="seconds"),
        "started_at": datetime.fromtimestamp(started_at, timezone.utc).isoformat(timespec="seconds")
        if started_at else None,
        "elapsed_s": round(now.timestamp() - started_at, 1) if started_at else None,
        "setup_s": round(setup_s, 1) if setup_s is not None else None, "finished": finished, "dry_run": dry_run,
        "passed": finished and not pending and bool(checks) and counts["passed"] == len(checks),
        "counts": counts, "pending": list(pending), "commit": commit, "command": command,
        "overrides": list(overrides), "budget": dict(budget), "machine": dict(machine),
        "work": str(work) if work else None, "checks": checks, "docs_rows": rows,
    }
    json_path = out / JSON_FILE
    _write_atomically(json_path, json.dumps(data, indent=1, default=str) + "\n")
    md_path = out / MD_FILE
    _write_atomically(md_path, render_markdown(data))
    setup_log = Path(work) / "setup.log" if work else None
    _write_atomically(out / LOGS_FILE, _logs(results, setup_log if setup_log and setup_log.is_file() else None))
    return md_path, json_path
