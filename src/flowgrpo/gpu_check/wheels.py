"""The wheels the quick GPU check carries to a lent GPU machine: which ones (derived), fetched here, checked there.

The lent machines reach no network, and their image (``scripts/gpu_image_packages.txt``) has torch, transformers,
accelerate, peft and most of the scientific stack, but not diffusers or datasets. What is missing travels as wheels
in the ignored folder ``.whl/`` of the working tree and is installed there into a temporary folder
(``scripts/gpu_quick.sh``). The set is derived, not written by hand (:func:`derive_wheel_set`):

1. **Traced imports** ``T``: a fresh interpreter imports the quick check's import roots
   (:data:`flowgrpo.gpu_check.quick.QUICK_IMPORT_ROOTS`: every check module and the names they import lazily), and
   every loaded top-level module is mapped to its distribution.
2. **Hard requirements** ``R``: flowgrpo's ``install_requires`` (setup.py), then the ``Requires-Dist`` of every
   distribution in ``R`` that the image lacks, recursively (markers evaluated for the machine, CPython 3.12 on
   Linux x86-64; extras ignored). A distribution the image has brings its own requirements there, so it is not
   followed.
3. **Roots** ``(T & R) - image``: what the check really imports, that the package really requires, and that the
   image lacks. Optional imports of what happens to be installed here (peft imports bitsandbytes when present) are
   not in ``R`` and are not carried.
4. **Closure**: every ``Requires-Dist`` of a carried distribution that the image lacks is carried too.

Versions: the ones installed here, in the environment the tests run in (for flowgrpo's own requirements they must
satisfy setup.py, whose lower bounds are those versions: diffusers 0.42.1, datasets 5.2.0).

``python -m flowgrpo.gpu_check.wheels download --dest .whl`` (``make gpu-wheels``) fetches them (binary wheels for
CPython 3.12 on manylinux x86-64, one version each), removes anything else from the folder, writes
``manifest.json`` and refuses a set over :data:`WHEEL_BUDGET_BYTES`. ``python -m flowgrpo.gpu_check.wheels verify
--site DIR`` (on the machine, after the install) checks that every carried distribution's requirements are met by
what is importable there, with versions.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEVICE_ENVIRONMENT", "DOWNLOAD_PLATFORMS", "IMAGE_PACKAGES_FILE", "WHEEL_BUDGET_BYTES", "ImagePackages",
           "WheelSet", "derive_wheel_set", "download_command", "download_wheels", "flowgrpo_requirements",
           "hard_requirements", "loaded_distributions", "main", "normalize", "read_image_packages",
           "requirements_of", "trace_imports", "verify_site", "wheel_metadata"]

#: what ``.whl/`` may weigh: the working tree that travels is at most 64 MiB, the repository about 8 MB of it
WHEEL_BUDGET_BYTES = 40 * 2**20
IMAGE_PACKAGES_FILE = "scripts/gpu_image_packages.txt"
#: the lent machines' interpreter, for evaluating requirement markers here
DEVICE_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                      "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                      "platform_system": "Linux", "platform_machine": "x86_64"}
DOWNLOAD_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                      "manylinux2014_x86_64", "manylinux1_x86_64")


def normalize(name: str) -> str:
    """A distribution name in PEP 503 form (``Jinja2`` -> ``jinja2``, ``typing_extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class ImagePackages:
    """The image's distributions (normalised names) and the versions known of some of them."""

    names: frozenset[str]
    versions: Mapping[str, str]
    header: str = ""

    def __contains__(self, name: str) -> bool:
        return normalize(name) in self.names


def read_image_packages(path: str | os.PathLike) -> ImagePackages:
    """``scripts/gpu_image_packages.txt``: one ``name`` or ``name==version`` a line; ``#`` starts a comment."""
    names, versions, header = set(), {}, []
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#"):
            header.append(line.lstrip("# "))
            continue
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise ValueError(f"{path}: {raw!r} is not a package name (write one 'name' or 'name==version' a line)")
        names.add(normalize(name.strip()))
        if version.strip():
            versions[normalize(name.strip())] = version.strip()
    if not names:
        raise ValueError(f"{path} lists no package; it must hold the image's package list, one name a line")
    return ImagePackages(frozenset(names), versions, " ".join(header))


# ---- requirements ---------------------------------------------------------------------------------------------------

def _requirement(text: str):
    from packaging.requirements import Requirement

    return Requirement(text)


def _applies(req, environment: Mapping[str, str]) -> bool:
    """A requirement that holds on the machine without extras (markers evaluated for ``environment``)."""
    if req.marker is None:
        return True
    return bool(req.marker.evaluate({**environment, "extra": ""}))


def requirements_of(name: str, requires: Sequence[str] | None = None,
                    environment: Mapping[str, str] = DEVICE_ENVIRONMENT) -> list:
    """The ``Requires-Dist`` of an installed distribution (or of ``requires``) that apply on the machine."""
    if requires is None:
        from importlib.metadata import distribution

        requires = distribution(name).requires or []
    return [r for r in map(_requirement, requires) if _applies(r, environment)]


def flowgrpo_requirements(setup_py: str | os.PathLike) -> list:
    """flowgrpo's ``INSTALL_REQUIRES`` (the list literal in setup.py; read, not executed)."""
    tree = ast.parse(Path(setup_py).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INSTALL_REQUIRES" for t in node.targets):
            return [_requirement(text) for text in ast.literal_eval(node.value)]
    raise ValueError(f"{setup_py} has no INSTALL_REQUIRES list")


def hard_requirements(direct: Iterable, image: ImagePackages, requires_of=requirements_of) -> dict[str, list]:
    """``{name: [requirements naming it]}``: ``direct`` and, through every distribution the image lacks, their
    requirements, recursively (step 2 of the module docstring)."""
    found: dict[str, list] = {}
    pending = list(direct)
    while pending:
        req = pending.pop()
        name = normalize(req.name)
        seen = name in found
        found.setdefault(name, []).append(req)
        if seen or name in image:
            continue
        try:
            pending.extend(requires_of(name))
        except Exception as err:  # noqa: BLE001 - not installed here: say which requirement pulled it in
            raise LookupError(f"{req} (a requirement of the quick GPU check) is not installed here, so its own "
                              f"requirements cannot be read; install it in this environment ({err})") from err
    return found


# ---- tracing what the check imports ---------------------------------------------------------------------------------

_TRACE_SCRIPT = r"""
import importlib, json, sys
for root in sys.argv[1:]:
    module, _, attribute = root.partition(":")
    loaded = importlib.import_module(module)
    if attribute:
        getattr(loaded, attribute)
from flowgrpo.gpu_check.wheels import loaded_distributions
print("FLOWGRPO-TRACE " + json.dumps(loaded_distributions()))
"""


def loaded_distributions() -> dict[str, dict[str, str]]:
    """``{distribution: {"version", "location"}}`` of every top-level module this process has imported (modules of no
    distribution, such as the standard library or a source tree on ``PYTHONPATH``, are left out)."""
    from importlib.metadata import distribution, packages_distributions

    owners = packages_distributions()
    tops = {name.split(".", 1)[0] for name in list(sys.modules)}
    out: dict[str, dict[str, str]] = {}
    for top in sorted(tops):
        for dist_name in owners.get(top, ()):
            key = normalize(dist_name)
            if key in out:
                continue
            try:
                dist = distribution(dist_name)
                location = str(dist.locate_file(""))
            except Exception:  # noqa: BLE001 - a broken metadata folder: name it without details
                out[key] = {"version": "?", "location": "?"}
                continue
            out[key] = {"version": dist.version, "location": location}
    return out


def trace_imports(roots: Sequence[str], *, python: str | None = None, src: str | os.PathLike | None = None,
                  timeout_s: float = 300) -> dict[str, dict[str, str]]:
    """Import ``roots`` (``module`` or ``module:attribute``) in a fresh interpreter; what it loaded, by distribution."""
    env = dict(os.environ)
    src = str(src or Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    done = subprocess.run([python or sys.executable, "-c", _TRACE_SCRIPT, *roots], capture_output=True, text=True,
                          env=env, timeout=timeout_s)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("FLOWGRPO-TRACE ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"importing the quick check's modules failed (exit {done.returncode}); fix the import "
                           f"before deriving the wheels:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


# ---- the derived set ------------------------------------------------------------------------------------------------

@dataclass
class WheelSet:
    """The derived set: ``wheels`` ``{name: version}`` and why each is there."""

    wheels: dict[str, str]
    reasons: dict[str, str]
    traced_missing_optional: list[str] = field(default_factory=list)
    image_requirements: dict[str, str] = field(default_factory=dict)

    def specs(self) -> list[str]:
        return [f"{name}=={version}" for name, version in sorted(self.wheels.items())]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _installed_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def derive_wheel_set(traced: Mapping[str, Any], image: ImagePackages, direct: Sequence, *,
                     requires_of=requirements_of, installed_version=_installed_version) -> WheelSet:
    """Steps 2-4 of the module docstring, from the traced distributions ``traced`` and flowgrpo's requirements
    ``direct``. ``requires_of(name)`` and ``installed_version(name)`` read this environment (replaceable in tests)."""
    hard = hard_requirements(direct, image, requires_of)
    specifiers = {normalize(req.name): req for req in direct}
    roots = sorted(normalize(n) for n in traced if normalize(n) in hard and normalize(n) not in image)
    optional = sorted(normalize(n) for n in traced if normalize(n) not in hard and normalize(n) not in image
                      and normalize(n) != "flowgrpo")
    wheels: dict[str, str] = {}
    reasons: dict[str, str] = {}
    image_reqs: dict[str, str] = {}
    pending = [(name, "imported by the quick check") for name in roots]
    while pending:
        name, why = pending.pop(0)
        if name in wheels:
            continue
        version = installed_version(name)
        if version is None:
            raise LookupError(f"{name} ({why}) is not installed here; install it (pip install {name}) so that its "
                              "version and requirements can be read")
        req = specifiers.get(name)
        if req is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
            raise LookupError(f"{name} {version} is installed here but setup.py requires {req}; install a version "
                              "that satisfies it (the tests' version) before deriving the wheels")
        if req is not None:
            why += f"; setup.py: {req}"
        wheels[name], reasons[name] = version, why
        for req in requires_of(name):
            dep = normalize(req.name)
            if dep in image:
                image_reqs.setdefault(dep, str(req.specifier) or "any")
                continue
            pending.append((dep, f"required by {name} ({req})"))
    return WheelSet(wheels, reasons, optional, image_reqs)


# ---- fetching -------------------------------------------------------------------------------------------------------

def download_command(specs: Sequence[str], dest: str | os.PathLike, python: str | None = None) -> list[str]:
    """``pip download`` of binary wheels for the machine (CPython 3.12, manylinux x86-64), without dependencies."""
    command = [python or sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
               "--abi", "none"]
    for platform in DOWNLOAD_PLATFORMS:
        command += ["--platform", platform]
    return command + ["--dest", str(dest), *specs]


def _wheel_name_version(path: Path) -> tuple[str, str]:
    parts = path.name[:-len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def wheel_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Name, version and ``Requires-Dist`` lines of a wheel file (its ``*.dist-info/METADATA``)."""
    with zipfile.ZipFile(path) as archive:
        meta = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise ValueError(f"{path} is not a wheel (no *.dist-info/METADATA)")
        text = archive.read(meta).decode("utf-8", errors="replace")
    fields: dict[str, Any] = {"requires": []}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key == "Name":
            fields["name"] = value.strip()
        elif key == "Version":
            fields["version"] = value.strip()
        elif key == "Requires-Dist":
            fields["requires"].append(value.strip())
    return fields


def download_wheels(wheel_set: WheelSet, dest: str | os.PathLike, *, python: str | None = None,
                    budget_bytes: int = WHEEL_BUDGET_BYTES, run=subprocess.run) -> dict[str, Any]:
    """Fetch ``wheel_set`` into ``dest``, keep exactly one wheel per distribution (anything else in the folder is
    removed), check each wheel's own metadata and the total size; returns the manifest (also ``manifest.json``)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = dict(wheel_set.wheels)
    for path in dest.glob("*.whl"):
        name, version = _wheel_name_version(path)
        if wanted.get(name) != version:
            path.unlink()
    missing = [f"{n}=={v}" for n, v in sorted(wanted.items())
               if not any(_wheel_name_version(p) == (n, v) for p in dest.glob("*.whl"))]
    if missing:
        run(download_command(missing, dest, python), check=True)
    files = {}
    for path in sorted(dest.glob("*.whl")):
        name, version = _wheel_name_version(path)
        meta = wheel_metadata(path)
        if normalize(meta.get("name", "")) != name or meta.get("version") != version:
            raise ValueError(f"{path.name}: its metadata says {meta.get('name')} {meta.get('version')}")
        files[name] = {"file": path.name, "version": version, "bytes": path.stat().st_size,
                       "pure_python": path.name.endswith("-none-any.whl")}
    absent = sorted(set(wanted) - set(files))
    if absent:
        raise RuntimeError(f"no wheel was fetched for {absent}")
    total = sum(f["bytes"] for f in files.values())
    manifest = {"total_bytes": total, "budget_bytes": budget_bytes, "wheels": files, "derivation": wheel_set.to_dict()}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if total > budget_bytes:
        raise RuntimeError(f"the wheels weigh {total / 2**20:.1f} MiB, over the {budget_bytes / 2**20:.0f} MiB the "
                           "working tree can carry beside the repository; carry less (see manifest.json)")
    return manifest


# ---- on the machine ---------------------------------------------------------------------------------------------------

def verify_site(site: str | os.PathLike, environment: Mapping[str, str] | None = None,
                project_requirements: Sequence = ()) -> dict[str, Any]:
    """Every distribution installed in ``site``, its version, and each of its requirements checked against what this
    interpreter can import (``site`` first on ``sys.path`` is the caller's business: ``PYTHONPATH``); then
    ``project_requirements`` (flowgrpo's own, from setup.py) the same way: a version outside one is a problem, a
    distribution that is not there at all is listed under ``absent`` (the quick check does not import every one of
    them: trl, say)."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    from packaging.markers import default_environment

    env = dict(default_environment()) if environment is None else dict(environment)
    carried: dict[str, str] = {}
    problems: list[str] = []
    checked: dict[str, dict[str, str]] = {}
    for dist in distributions(path=[str(site)]):
        name = normalize(dist.metadata["Name"])
        carried[name] = dist.version
        for req in requirements_of(name, dist.requires or [], env):
            try:
                found = version(req.name)
            except PackageNotFoundError:
                problems.append(f"{name} {dist.version} needs {req}: not installed")
                continue
            ok = req.specifier.contains(found, prereleases=True) if req.specifier else True
            checked.setdefault(name, {})[str(req)] = found
            if not ok:
                problems.append(f"{name} {dist.version} needs {req}: {normalize(req.name)} {found} is installed")
    if not carried:
        problems.append(f"nothing is installed in {site}: the carried wheels are missing (make gpu-wheels)")
    absent: list[str] = []
    for req in project_requirements:
        if not _applies(req, env):
            continue
        try:
            found = version(req.name)
        except PackageNotFoundError:
            absent.append(str(req))
            continue
        checked.setdefault("flowgrpo", {})[str(req)] = found
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            problems.append(f"flowgrpo needs {req}: {normalize(req.name)} {found} is installed")
    return {"site": str(site), "carried": dict(sorted(carried.items())), "requirements": checked, "problems": problems,
            "absent": absent}


# ---- command line ------------------------------------------------------------------------------------------------------

def _repo() -> Path:
    return Path(__file__).resolve().parents[3]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowgrpo.gpu_check.wheels",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("derive", "print the derived wheel set"),
                            ("download", "fetch the derived set into --dest (make gpu-wheels)")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--image-packages", default=str(_repo() / IMAGE_PACKAGES_FILE))
        p.add_argument("--setup-py", default=str(_repo() / "setup.py"))
        if name == "download":
            p.add_argument("--dest", default=str(_repo() / ".whl"))
    p = sub.add_parser("verify", help="check the requirements of what is installed in --site (on the machine)")
    p.add_argument("--site", required=True)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--setup-py", default=None, help="also check flowgrpo's install_requires (setup.py)")
    p.add_argument("--import", dest="imports", nargs="*", default=[],
                   help="modules to import afterwards (their versions are recorded; a failure is a problem)")
    args = parser.parse_args(argv)

    if args.command == "verify":
        project = flowgrpo_requirements(args.setup_py) if args.setup_py else ()
        result = verify_site(args.site, project_requirements=project)
        result["imported"] = {}
        for module in args.imports:
            try:
                loaded = __import__(module)
                result["imported"][module] = {"version": str(getattr(loaded, "__version__", "?")),
                                              "file": str(getattr(loaded, "__file__", "?"))}
            except Exception as err:  # noqa: BLE001 - recorded, the quick check carries on
                result["problems"].append(f"import {module}: {type(err).__name__}: {err}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        from .probe import write_result

        imported = ", ".join(f"{k} {v['version']}" for k, v in result["imported"].items())
        summary = (f"{len(result['carried'])} carried ({', '.join(f'{k} {v}' for k, v in result['carried'].items())})"
                   f"; requirements {'met' if not result['problems'] else 'NOT met'}"
                   + (f"; imported {imported}" if imported else "")
                   + (f"; not installed: {', '.join(result['absent'])}" if result["absent"] else ""))
        write_result(not result["problems"], {"wheels": result}, result["problems"], summary)
        print(summary)
        for problem in result["problems"]:
            print(f"problem: {problem}")
        return 0 if not result["problems"] else 1

    from .quick import QUICK_IMPORT_ROOTS

    image = read_image_packages(args.image_packages)
    try:
        traced = trace_imports(QUICK_IMPORT_ROOTS)
        wheel_set = derive_wheel_set(traced, image, flowgrpo_requirements(args.setup_py))
    except (LookupError, RuntimeError) as err:
        print(f"gpu-wheels: error: {err}", file=sys.stderr)
        return 2
    print(f"derived from {len(traced)} imported distributions against {len(image.names)} image packages:")
    for name, version in sorted(wheel_set.wheels.items()):
        print(f"  {name + '==' + version:<28} {wheel_set.reasons[name]}")
    if wheel_set.traced_missing_optional:
        print("  imported here but optional (not required by flowgrpo), not carried: "
              + ", ".join(wheel_set.traced_missing_optional))
    if args.command == "derive":
        return 0
    try:
        manifest = download_wheels(wheel_set, args.dest)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as err:
        print(f"gpu-wheels: error: {err}", file=sys.stderr)
        return 1
    print(f"{len(manifest['wheels'])} wheels in {args.dest}: {manifest['total_bytes'] / 2**20:.2f} MiB of the "
          f"{manifest['budget_bytes'] / 2**20:.0f} MiB budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
