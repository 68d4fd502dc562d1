"""Shared test set-up: everything offline, one core's worth of threads per test worker, cached tiny pipelines.

The suite runs in parallel pytest-xdist workers (``make test``: one per core). Each worker gets its share of the
cores through ``FLOWGRPO_CPU_THREADS`` (the trainers' thread policy, ``flowgrpo.cpu_threads``) and torch's own
setting, so that two workers never oversubscribe the machine. Tiny pipelines live in the user cache
(``flowgrpo.testing.cached_tiny_pipeline_path``: fingerprinted, built once under a lock, shared by the workers).
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cores_per_worker() -> int:
    from flowgrpo.cpu_threads import usable_cores

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, usable_cores() // max(1, workers))


os.environ.setdefault("FLOWGRPO_CPU_THREADS", str(_cores_per_worker()))
os.environ.setdefault("OMP_NUM_THREADS", os.environ["FLOWGRPO_CPU_THREADS"])


#: Measured durations (seconds, two workers on two cores) of the tests that take more than a second, by node id:
#: the order in which the workers take the tests (longest first). ``pytest --store-durations`` rewrites it.
DURATIONS_FILE = Path(__file__).parent / "durations.json"
#: the tests that take longer than this are recorded in DURATIONS_FILE
RECORDED_ABOVE_S = 1.0
#: what a ``run_first`` test not yet in DURATIONS_FILE is taken to last
RUN_FIRST_S = 60.0


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write the durations of this run's tests over {RECORDED_ABOVE_S:g} s to "
                          "tests/durations.json (the order of the next runs)")


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["FLOWGRPO_CPU_THREADS"]))
    config.addinivalue_line("markers", "run_first: a long test that parallel workers should start first")
    # --dist loadgroup schedules by scope (each xdist group, each other test on its own), and by default reorders the
    # scopes by their number of tests; keep the order of pytest_collection_modifyitems below (longest first) instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _group_suffix(item) -> str | None:
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    return "_".join(names) if names else None


def _apply_xdist_group(item, group: str) -> None:
    """Give ``item`` the node id ``<nodeid>@<group>`` that --dist loadgroup schedules as one unit.

    pytest-xdist's worker does this itself (``WorkerInteractor.pytest_collection_modifyitems``) by assigning
    ``item._nodeid``; since pytest 9.2 the node id is read from ``item._id`` (a ``NodeId``), so that assignment has no
    effect and every grouped test would be scheduled on its own (two workers each building the shared artefact).
    Set it where pytest reads it; a later xdist that does so itself leaves nothing to do here."""
    nodeid = f"{item.nodeid}@{group}"
    if item.nodeid.endswith(f"@{group}"):
        return
    current = getattr(item, "_id", None)
    if current is not None and not isinstance(current, str) and hasattr(type(current), "parse"):
        item._id = type(current).parse(nodeid)
    else:
        item._nodeid = nodeid
    assert item.nodeid == nodeid, (item.nodeid, nodeid)


def _base_nodeid(nodeid: str) -> str:
    """The node id without the xdist group suffix (``path::test[param]@group`` -> ``path::test[param]``)."""
    return nodeid[:nodeid.rindex("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook, which reads the marks too
def pytest_collection_modifyitems(session, config, items):
    """The longest units first (a test file, or all the tests of an xdist group together), by the durations recorded
    in tests/durations.json (``run_first`` tests not recorded yet count as long). xdist then hands the workers the
    tests in this order (--dist loadgroup, reordering off: see pytest_configure), so both workers start on the long
    files at once and finish on short ones: the suite's wall time comes close to its CPU time divided by the workers,
    instead of a long test running alone at the end. A file's tests stay together, in their collection order: a
    worker that went to another file between two of them would tear down and build the file's module fixtures (a
    trained baseline, a launch) again."""
    import json

    recorded = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.is_file() else {}
    loadgroup = bool(config.getvalue("loadgroup")) if hasattr(config.option, "loadgroup") else False

    def estimate(item) -> float:
        unrecorded = RUN_FIRST_S if item.get_closest_marker("run_first") else 0.0
        return recorded.get(_base_nodeid(item.nodeid), unrecorded)

    units: dict[str, float] = {}
    keys = []
    for item in items:
        group = _group_suffix(item)
        if group and loadgroup:
            _apply_xdist_group(item, group)
        unit = f"@{group}" if group else item.nodeid.split("::", 1)[0]
        units[unit] = units.get(unit, 0.0) + estimate(item)
        keys.append(unit)
    # a unit's tests stay together, in their collection order: the unit's first test gives the unit its place
    first_index = {}
    for index, unit in enumerate(keys):
        first_index.setdefault(unit, index)
    order = {id(item): (-units[unit], first_index[unit], index) for index, (item, unit) in enumerate(zip(items, keys))}
    items.sort(key=lambda item: order[id(item)])


@pytest.fixture(autouse=True)
def _no_half_initialised_accelerator_state(request):
    """Clear accelerate's shared state when a test leaves it half-initialised, naming the test in a warning.

    A bare ``AcceleratorState()`` while no Accelerator exists raises ("Please make sure to properly initialize your
    accelerator") after it has stored its plugins in the shared state but before ``_mixed_precision``; the next
    ``Accelerator`` of the same worker then fails in ``_check_initialized`` (``no attribute _mixed_precision``). Which
    test runs next on a worker depends on the order of the suite, so the leak is cleared where it happens."""
    yield
    import sys

    state_module = sys.modules.get("accelerate.state")
    if state_module is None:
        return
    shared = state_module.AcceleratorState._shared_state
    if shared and "_mixed_precision" not in shared:
        import warnings

        shared.clear()
        warnings.warn(f"{request.node.nodeid} left accelerate's AcceleratorState half-initialised (cleared)",
                      stacklevel=1)


def pytest_collection_finish(session):
    """What collection imported (torch, diffusers, transformers, flowgrpo, the test modules: about 600 000 objects
    that live as long as the worker) is moved out of the cyclic garbage collector's reach (``gc.freeze``). Without
    this, every full collection walks it again: each trainer's ``train()`` starts with one (accelerate's
    ``free_memory``) and the interpreter runs more on its own, 0.4 s each; they took 38% of the time of
    tests/trainer/test_trainer.py. Garbage is collected first, so that nothing frozen is garbage."""
    from flowgrpo.process_gc import freeze_what_is_alive

    freeze_what_is_alive()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The same at the end of each test module, once its fixtures are gone: what is still alive then (the session's
    fixtures, the libraries' caches, modules imported since) is frozen too, after a collection of the module's
    garbage (full collections over tests/trainer/algorithms: 3.9 s without, 2.5 s with, these collections included)."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        from flowgrpo.process_gc import freeze_what_is_alive

        freeze_what_is_alive()


#: this run's durations (setup, call and teardown together), by node id without the group suffix
_MEASURED: dict[str, float] = {}


def pytest_runtest_logreport(report):
    nodeid = _base_nodeid(report.nodeid)
    _MEASURED[nodeid] = _MEASURED.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """``--store-durations``: the controller (or a run without workers) writes the durations of the tests over
    RECORDED_ABOVE_S, keeping the recorded ones this run did not run."""
    import json

    if not session.config.getoption("store_durations") or hasattr(session.config, "workerinput"):
        return
    recorded = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.is_file() else {}
    recorded = {k: v for k, v in recorded.items() if k not in _MEASURED}
    recorded.update({k: round(v, 1) for k, v in _MEASURED.items() if v > RECORDED_ABOVE_S})
    DURATIONS_FILE.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")


@pytest.fixture(scope="session")
def tiny_pipeline_cache():
    """Folder of the cached tiny pipelines: the user cache (``$FLOWGRPO_TINY_PIPELINE_CACHE`` or
    ``~/.cache/flowgrpo/tiny-pipelines``), shared by parallel workers and by later runs."""
    return None


@pytest.fixture(scope="session")
def tiny_sd3_path(tiny_pipeline_cache):
    """Path of a tiny StableDiffusion3Pipeline (seed 0) saved with ``save_pretrained``, built once per session."""
    from flowgrpo.testing import cached_tiny_pipeline_path

    return cached_tiny_pipeline_path("sd3", seed=0, cache_dir=tiny_pipeline_cache)


@pytest.fixture(scope="session")
def tiny_flux_path(tiny_pipeline_cache):
    """Path of a tiny FluxPipeline (seed 0) saved with ``save_pretrained``, built once per session."""
    from flowgrpo.testing import cached_tiny_pipeline_path

    return cached_tiny_pipeline_path("flux", seed=0, cache_dir=tiny_pipeline_cache)


@pytest.fixture(scope="session")
def tiny_pipeline_path(tiny_pipeline_cache):
    """``tiny_pipeline_path(family, variant=None)``: a tiny pipeline of any of ``flowgrpo.testing.TINY_FAMILIES``
    saved with ``save_pretrained``, built once per session."""
    from flowgrpo.testing import cached_tiny_pipeline_path

    def path(family: str, variant: str | None = None):
        return cached_tiny_pipeline_path(family, seed=0, cache_dir=tiny_pipeline_cache, variant=variant)

    return path


@pytest.fixture(scope="session")
def toy_light_world(tmp_path_factory):
    """The toy world's ``light`` preset (seconds to build), built once per session; read only by its tests (the
    ``toy_light_world`` xdist group runs them all in one worker)."""
    from flowgrpo.toy.build import build_toy_world

    path = tmp_path_factory.mktemp("toy") / "world"
    build_toy_world(path, seed=0, config="light", log=lambda message: None)
    return path
