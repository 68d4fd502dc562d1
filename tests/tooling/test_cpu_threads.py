"""The CPU thread policy (flowgrpo.cpu_threads) and the build-once cache (flowgrpo.build_cache)."""

import multiprocessing
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from flowgrpo.build_cache import build_folder_once
from flowgrpo.cpu_threads import (
    ALL_CORES_MIN_PARAMETERS,
    CPU_THREADS_ENV,
    ThreadTimeline,
    apply_cpu_thread_plan,
    background_task,
    busy_background_threads,
    current_cpu_thread_plan,
    fixed_main_threads,
    install_main_thread_yield,
    limit_worker_threads,
    parse_cpu_threads,
    plan_cpu_threads,
    reward_thread_count,
    usable_cores,
)


@pytest.fixture
def restore_threads():
    previous, plan = torch.get_num_threads(), current_cpu_thread_plan()
    yield
    torch.set_num_threads(previous)
    apply_cpu_thread_plan(plan)


def test_auto_plan_leaves_one_core_of_the_process_share_for_background_threads(monkeypatch):
    monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = usable_cores()
    plan = plan_cpu_threads("auto")
    assert plan.cores_per_process == cores and plan.torch_threads == max(1, cores - 1)
    assert plan.worker_torch_threads == 1 and plan.reward_threads == 1

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more processes than cores: one thread each
    assert plan_cpu_threads("auto").torch_threads == 1
    monkeypatch.setenv(CPU_THREADS_ENV, "6")  # an explicit share wins over the machine's
    plan = plan_cpu_threads("auto")
    assert (plan.cores_per_process, plan.torch_threads) == (6, 5) and CPU_THREADS_ENV in plan.source
    # A model whose operations split well takes every core of the share; below the threshold, one is left free.
    big = plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS)
    assert big.torch_threads == 6 and big.worker_torch_threads == 1 and "every core" in big.source
    assert plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS - 1).torch_threads == 5
    assert plan_cpu_threads(2, model_parameters=10 * ALL_CORES_MIN_PARAMETERS).torch_threads == 2  # fixed wins
    monkeypatch.setenv(CPU_THREADS_ENV, "1")
    assert plan_cpu_threads("auto", model_parameters=10 * ALL_CORES_MIN_PARAMETERS).torch_threads == 1
    monkeypatch.setenv(CPU_THREADS_ENV, "6")
    assert plan_cpu_threads(3).torch_threads == 3 and plan_cpu_threads("3").worker_torch_threads == 1
    assert plan_cpu_threads("keep") is None
    gpu = plan_cpu_threads("auto", on_cpu=False)  # the transformer is elsewhere: the rewards get the cores
    assert gpu.reward_threads == 6 and gpu.torch_threads == torch.get_num_threads()


@pytest.mark.parametrize("bad", ["fast", "0", -2, 0, True, "1.5"])
def test_bad_settings_name_the_value_and_the_choices(bad):
    with pytest.raises(ValueError, match="auto"):
        parse_cpu_threads(bad)


def test_config_validates_cpu_threads(tmp_path):
    from flowgrpo import FlowGRPOConfig

    assert FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], cpu_threads="2").cpu_threads == "2"
    assert FlowGRPOConfig(output_dir=str(tmp_path), report_to=[]).cpu_threads == "auto"
    with pytest.raises(ValueError, match="cpu_threads='many'"):
        FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], cpu_threads="many")


def test_applied_plan_sets_main_and_worker_threads_separately(monkeypatch, restore_threads):
    monkeypatch.setenv(CPU_THREADS_ENV, "3")
    plan = apply_cpu_thread_plan(plan_cpu_threads("auto"))
    assert torch.get_num_threads() == 2 and current_cpu_thread_plan() is plan and reward_thread_count() == 1
    seen = []

    def worker():
        limit_worker_threads()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1] and torch.get_num_threads() == 2  # the worker's setting is its own
    apply_cpu_thread_plan(None)
    assert current_cpu_thread_plan() is None and reward_thread_count(7) == 7


def test_trainer_applies_the_policy_to_itself_and_its_background_pools(tiny_sd3_path, tmp_path, monkeypatch,
                                                                          restore_threads):
    from datasets import Dataset

    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer

    monkeypatch.setenv(CPU_THREADS_ENV, "3")
    seen, busy = [], []

    def reward(prompts, images, **columns):
        seen.append(torch.get_num_threads())
        busy.append(busy_background_threads())
        return [0.0] * len(images)

    args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2, num_generations=2,
                          resolution=32, num_inference_steps=2, guidance_scale=1.0, max_steps=1, beta=0.0,
                          max_sequence_length=8, save_strategy="no", disable_tqdm=True, log_images_steps=0,
                          dtype="float32", use_cpu=True)
    trainer = FlowGRPOTrainer(model=str(tiny_sd3_path), reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}))
    assert trainer.cpu_thread_plan.torch_threads == 2 and torch.get_num_threads() == 2
    trainer.train()
    assert seen == [1]  # the reward ran in a background worker with one thread
    # counted busy while it ran (with the decode task that handed it over, if that has not returned yet)
    assert busy[0] in (1, 2) and busy_background_threads() == 0
    assert torch.get_num_threads() == 2


def test_main_thread_yields_one_core_per_busy_background_task(monkeypatch, restore_threads):
    """With every core on the main thread (a large model), each block of the transformer starts with one torch
    thread fewer per busy background task, and with all of them once the background is idle."""
    monkeypatch.setenv(CPU_THREADS_ENV, "3")
    assert not plan_cpu_threads("auto").yield_to_background  # a small model keeps a core free: nothing to yield
    assert not plan_cpu_threads(3, model_parameters=ALL_CORES_MIN_PARAMETERS).yield_to_background  # fixed: kept
    plan = apply_cpu_thread_plan(plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS))
    assert plan.torch_threads == 3 and plan.yield_to_background and "fewer" in plan.describe()
    monkeypatch.setenv("FLOWGRPO_CPU_SPLIT", "nice")  # the other splits, for measurements
    nice = plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS)
    assert nice.background_nice and not nice.yield_to_background
    monkeypatch.setenv("FLOWGRPO_CPU_SPLIT", "sideways")
    with pytest.raises(ValueError, match="FLOWGRPO_CPU_SPLIT='sideways'"):
        plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS)
    monkeypatch.delenv("FLOWGRPO_CPU_SPLIT")
    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    handles = install_main_thread_yield([model])
    assert len(handles) == 4  # the root and the one block, each before its forward and (for backward) after it
    model[1][0].register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))  # runs after

    def forward():
        model[1][0](model[0](torch.ones(1, 4)))

    started, release = threading.Event(), threading.Event()

    def busy_task():
        started.set()
        release.wait(10)
        return "done"

    forward()
    for busy in (1, 2):
        threads = [threading.Thread(target=background_task, args=(busy_task,)) for _ in range(busy)]
        for thread in threads:
            thread.start()
        while busy_background_threads() < busy:
            started.wait(0.01)
        forward()
        release.set()
        for thread in threads:
            thread.join()
        release.clear()
    forward()
    assert seen == [3, 2, 1, 3] and busy_background_threads() == 0
    assert background_task(lambda a, b=0: a + b, 1, b=2) == 3
    for handle in handles:
        handle.remove()
    apply_cpu_thread_plan(plan_cpu_threads("auto"))
    assert install_main_thread_yield([model]) == []


def test_main_thread_yield_follows_the_background_in_backward(monkeypatch, restore_threads):
    """A background task that starts after a block's forward still takes its core back at the block's backward
    (the hook on the block output's gradient); ``yield-forward`` (the split before) leaves backward alone."""
    monkeypatch.setenv(CPU_THREADS_ENV, "3")
    started, release = threading.Event(), threading.Event()

    def busy_task():
        started.set()
        release.wait(10)

    for split, expected in (("yield", 2), ("yield-forward", 3)):
        monkeypatch.setenv("FLOWGRPO_CPU_SPLIT", split)
        apply_cpu_thread_plan(plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
        handles = install_main_thread_yield([model])
        assert len(handles) == (4 if split == "yield" else 2)
        x = torch.ones(1, 4, requires_grad=True)
        hidden = model[0](x)
        seen = []
        hidden.register_hook(lambda grad, seen=seen: seen.append(torch.get_num_threads()))  # runs after the block's backward
        out = model[1][0](hidden)
        assert torch.get_num_threads() == 3  # the background was idle during the forward
        thread = threading.Thread(target=background_task, args=(busy_task,))
        thread.start()
        started.wait(10)
        out.sum().backward()
        release.set()
        thread.join()
        release.clear()
        started.clear()
        assert seen == [expected], split
        assert torch.allclose(x.grad, (model[1][0].weight.sum(0) @ model[0].weight).detach())  # gradient unchanged
        with torch.no_grad():  # no gradient, no hook: nothing is registered on outputs in inference
            model[1][0](torch.ones(1, 4))
        for handle in handles:
            handle.remove()


def test_thread_timeline_measures_the_split(monkeypatch, restore_threads):
    """The timeline adds up the time the main thread spends at each thread count against the busy background tasks,
    and a take() starts a new period."""
    monkeypatch.setenv(CPU_THREADS_ENV, "2")
    monkeypatch.delenv("FLOWGRPO_CPU_SPLIT", raising=False)
    apply_cpu_thread_plan(plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS))
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    handles = install_main_thread_yield([model])
    started, release = threading.Event(), threading.Event()

    def busy_task():
        started.set()
        release.wait(10)

    timeline = ThreadTimeline().start()
    try:
        t0 = time.perf_counter()
        time.sleep(0.05)  # idle background, both threads
        thread = threading.Thread(target=background_task, args=(busy_task,))
        thread.start()
        started.wait(10)
        time.sleep(0.05)  # busy background, the main thread not yet at a block: oversubscribed
        model[0][0](torch.ones(1, 4))  # a block starts: the main thread yields one thread
        time.sleep(0.1)
        release.set()
        thread.join()
        time.sleep(0.05)  # idle background, the main thread still at one thread until its next block
        first = timeline.take()
        elapsed = time.perf_counter() - t0
        model[0][0](torch.ones(1, 4))  # back to both threads
        second = timeline.take()
    finally:
        timeline.stop()
        for handle in handles:
            handle.remove()
    assert set(first) == {"main=2 busy=0", "main=2 busy=1", "main=1 busy=1", "main=1 busy=0"}
    assert first["main=1 busy=1"] >= 0.09 and first["main=2 busy=1"] >= 0.04 and first["main=1 busy=0"] >= 0.04
    assert sum(first.values()) == pytest.approx(elapsed, abs=0.02)
    assert set(second) <= {"main=1 busy=0", "main=2 busy=0"} and sum(second.values()) < 0.5
    assert torch.get_num_threads() == 2


def test_fixed_main_threads_holds_the_count_against_the_background(monkeypatch, restore_threads):
    """Inside `fixed_main_threads` the blocks keep the chosen count even while the background is busy; afterwards the
    previous count, and the blocks follow the background again."""
    monkeypatch.setenv(CPU_THREADS_ENV, "2")
    monkeypatch.delenv("FLOWGRPO_CPU_SPLIT", raising=False)
    apply_cpu_thread_plan(plan_cpu_threads("auto", model_parameters=ALL_CORES_MIN_PARAMETERS))
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    handles = install_main_thread_yield([model])
    seen = []
    model[0][0].register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    started, release = threading.Event(), threading.Event()

    def busy_task():
        started.set()
        release.wait(10)

    thread = threading.Thread(target=background_task, args=(busy_task,))
    thread.start()
    started.wait(10)
    try:
        for n in (2, 1):
            with fixed_main_threads(n):
                model[0][0](torch.ones(1, 4))
            assert torch.get_num_threads() == 2
        model[0][0](torch.ones(1, 4))  # following again: one thread while the task is busy
    finally:
        release.set()
        thread.join()
        for handle in handles:
            handle.remove()
    assert seen == [2, 1, 1]
    with pytest.raises(ValueError, match="threads=0"):
        with fixed_main_threads(0):
            pass


def _build_counting(args):
    target, counter = args
    counter = Path(counter)

    def build(path: Path) -> None:
        with open(counter, "a") as f:
            f.write("x")
        path.mkdir()
        (path / "model_index.json").write_text("{}")

    return str(build_folder_once(target, build, what="test folder"))


def test_concurrent_processes_build_a_folder_once(tmp_path):
    target, counter = tmp_path / "cache" / "thing", tmp_path / "builds.txt"
    # the pool's workers are forks of this test worker: SIGTERM, which the pool's exit sends them, is put back to its
    # default (a trainer earlier in the worker may have installed its preemption handler, which forks inherit)
    with multiprocessing.get_context("fork").Pool(3, initializer=signal.signal,
                                                  initargs=(signal.SIGTERM, signal.SIG_DFL)) as pool:
        paths = pool.map(_build_counting, [(str(target), str(counter))] * 6)
    assert set(paths) == {str(target)} and counter.read_text() == "x"  # one build, six callers
    assert sorted(p.name for p in target.parent.iterdir()) == ["thing"]  # no staging folder, no lock left


def test_a_failed_build_leaves_nothing_and_an_occupied_target_is_refused(tmp_path):
    target = tmp_path / "thing"

    def failing(path: Path) -> None:
        path.mkdir()
        (path / "half.bin").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_folder_once(target, failing)
    assert not target.exists() and not [p for p in tmp_path.iterdir() if p.suffix != ".lock"]  # no staging left
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="holds no model_index.json"):
        build_folder_once(target, failing)
    assert (target / "mine.txt").read_text() == "keep"
