"""Reward registry, resolution of reward specifications, weighted composition and asynchronous scoring."""

import logging
import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from flowgrpo.rewards import (
    RewardResult,
    RewardSet,
    get_reward,
    list_rewards,
    register_reward,
    resolve_reward_funcs,
)
from flowgrpo.rewards.composition import reward_statistics

BUILTINS = {"ocr", "jpeg_compressibility", "jpeg_incompressibility", "aesthetic", "clipscore", "pickscore"}


def _images(n):
    return [Image.new("RGB", (8, 8), (i * 20 % 256, 0, 0)) for i in range(n)]


def prompt_length(prompts, images, **columns):
    return [float(len(p)) for p in prompts]


class ConstantReward:
    def __init__(self, value=1.0):
        self.value = value

    def __call__(self, prompts, images, **columns):
        return [self.value] * len(images)


# ---- registry ------------------------------------------------------------------------------------


def test_builtins_are_listed():
    names = list_rewards()
    assert BUILTINS <= set(names)
    assert names == sorted(names)


def test_import_is_light():
    code = (
        "import sys, flowgrpo.rewards as r; names = r.list_rewards(); "
        "heavy = [m for m in ('rapidocr', 'onnxruntime', 'transformers', 'torch') if m in sys.modules]; "
        "print(heavy); assert not heavy, heavy; assert 'ocr' in names"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_register_function_and_get_with_kwargs():
    @register_reward("test_scaled_length")
    def scaled_length(prompts, images, factor=1.0, **columns):
        return [factor * len(p) for p in prompts]

    assert "test_scaled_length" in list_rewards()
    assert get_reward("test_scaled_length") is scaled_length
    fn = get_reward("test_scaled_length", factor=2.0)
    assert fn(["ab", "abc"], _images(2)) == [4.0, 6.0]
    assert fn.__name__ == "scaled_length"


def test_register_class_is_instantiated_with_kwargs():
    @register_reward("test_constant")
    class Constant(ConstantReward):
        pass

    reward = get_reward("test_constant", value=0.25)
    assert isinstance(reward, Constant)
    assert reward(["a", "b"], _images(2)) == [0.25, 0.25]


def test_register_twice():
    def first(prompts, images, **columns):
        return [0.0] * len(images)

    def second(prompts, images, **columns):
        return [1.0] * len(images)

    register_reward("test_twice")(first)
    register_reward("test_twice")(first)  # the same object again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_twice")(second)
    register_reward("test_twice", overwrite=True)(second)
    assert get_reward("test_twice") is second


def test_bad_registrations():
    with pytest.raises(ValueError, match="non-empty"):
        register_reward("")
    with pytest.raises(ValueError, match="':'"):
        register_reward("a:b")
    with pytest.raises(TypeError, match="function or a class"):
        register_reward("test_not_callable")(42)


def test_unknown_name_lists_available_and_suggests():
    with pytest.raises(ValueError) as info:
        get_reward("ocrr")
    message = str(info.value)
    assert "unknown reward 'ocrr'" in message
    assert "Did you mean 'ocr'" in message
    for name in BUILTINS:
        assert name in message


# ---- resolution ------------------------------------------------------------------------------------


def test_resolve_names_callables_paths_and_classes():
    rs = resolve_reward_funcs(
        ["jpeg_incompressibility", prompt_length, f"{__name__}:prompt_length",
         f"{__name__}:ConstantReward", ConstantReward(0.5), ConstantReward],
        reward_kwargs=[None, None, None, {"value": 3.0}, None, {"value": 7.0}],
    )
    assert rs.names == ["jpeg_incompressibility", "prompt_length", "prompt_length_2", "ConstantReward",
                        "ConstantReward_2", "ConstantReward_3"]
    assert rs.weights == [1.0] * 6
    result = rs(["ab", "abcd"], _images(2))
    assert result.per_reward["prompt_length"] == [2.0, 4.0]
    assert result.per_reward["prompt_length_2"] == [2.0, 4.0]
    assert result.per_reward["ConstantReward"] == [3.0, 3.0]
    assert result.per_reward["ConstantReward_2"] == [0.5, 0.5]
    assert result.per_reward["ConstantReward_3"] == [7.0, 7.0]
    assert all(v > 0 for v in result.per_reward["jpeg_incompressibility"])


def test_single_string_and_kwargs_mapping():
    rs = resolve_reward_funcs("jpeg_compressibility", reward_kwargs={"jpeg_compressibility": {"quality": 50}})
    assert rs.names == ["jpeg_compressibility"]
    assert rs.funcs[0].keywords == {"quality": 50}
    rs = resolve_reward_funcs([f"{__name__}:ConstantReward"],
                              reward_kwargs={f"{__name__}:ConstantReward": {"value": 2.0}})
    assert rs(["x"], _images(1)).per_reward["ConstantReward"] == [2.0]


def test_resolution_errors():
    with pytest.raises(ValueError, match="unknown reward 'nope'.*Available rewards"):
        resolve_reward_funcs(["jpeg_compressibility", "nope"])
    with pytest.raises(ValueError, match="reward_weights has 1 entries but reward_funcs has 2"):
        resolve_reward_funcs(["jpeg_compressibility", prompt_length], reward_weights=[1.0])
    with pytest.raises(ValueError, match="not a finite number"):
        resolve_reward_funcs([prompt_length], reward_weights=[float("nan")])
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward_funcs("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward_funcs(f"{__name__}:missing")
    with pytest.raises(ValueError, match="empty"):
        resolve_reward_funcs([])
    with pytest.raises(TypeError, match="expected a name"):
        resolve_reward_funcs([3])
    with pytest.raises(ValueError, match=r"entries for \['ocrr'\]"):
        resolve_reward_funcs(["jpeg_compressibility"], reward_kwargs={"ocrr": {}})
    with pytest.raises(ValueError, match="reward_kwargs has 2 entries but reward_funcs has 1"):
        resolve_reward_funcs(["jpeg_compressibility"], reward_kwargs=[{}, {}])


# ---- composition -----------------------------------------------------------------------------------


def test_weighted_total_and_none():
    def sometimes_none(prompts, images, **columns):
        return [None if p == "skip" else 1.0 for p in prompts]

    rs = resolve_reward_funcs([prompt_length, sometimes_none], reward_weights=[0.5, -2.0])
    result = rs(["abcd", "skip", "ab"], _images(3))
    assert isinstance(result, RewardResult)
    assert result.per_reward == {"prompt_length": [4.0, 4.0, 2.0], "sometimes_none": [1.0, None, 1.0]}
    assert result.total == [0.0, None, -1.0]
    assert len(result) == 3
    stats = result.statistics()
    assert stats["rewards/prompt_length/mean"] == pytest.approx(10 / 3)
    assert stats["rewards/sometimes_none/mean"] == 1.0 and stats["rewards/sometimes_none/std"] == 0.0
    assert stats["reward"] == pytest.approx(-0.5) and stats["reward_std"] == pytest.approx(0.5)


def test_zero_weight_component_does_not_void_the_total():
    rs = resolve_reward_funcs([prompt_length, lambda p, i, **c: [None] * len(p)], reward_weights=[1.0, 0.0])
    assert rs(["abc"], _images(1)).total == [3.0]


def test_columns_are_passed_and_checked():
    seen = {}

    def uses_columns(prompts, images, **columns):
        seen.update(columns)
        return [float(t) for t in columns["target"]]

    rs = resolve_reward_funcs(uses_columns)
    assert rs(["a", "b"], _images(2), target=[1, 2]).total == [1.0, 2.0]
    assert seen == {"target": [1, 2]}
    with pytest.raises(ValueError, match="column 'target' has 1 values but there are 2 prompts"):
        rs(["a", "b"], _images(2), target=[1])
    with pytest.raises(ValueError, match="2 prompts but 1 images"):
        rs(["a", "b"], _images(1))


def test_wrong_count_and_bad_values_name_the_reward():
    def too_few(prompts, images, **columns):
        return [1.0]

    def not_a_list(prompts, images, **columns):
        return 1.0

    def strings(prompts, images, **columns):
        return ["high"] * len(prompts)

    with pytest.raises(ValueError, match="reward 'too_few' returned 1 scores for 2 images"):
        resolve_reward_funcs(too_few)(["a", "b"], _images(2))
    with pytest.raises(TypeError, match="reward 'not_a_list' returned a float"):
        resolve_reward_funcs(not_a_list)(["a"], _images(1))
    with pytest.raises(TypeError, match="reward 'strings' returned 'high'"):
        resolve_reward_funcs(strings)(["a"], _images(1))


def test_nan_becomes_none_with_a_warning(caplog):
    def with_nan(prompts, images, **columns):
        return [1.0, float("nan"), float("inf")]

    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.composition"):
        result = resolve_reward_funcs([with_nan, prompt_length])(["a", "b", "c"], _images(3))
    assert result.per_reward["with_nan"] == [1.0, None, None]
    assert result.total == [2.0, None, None]
    assert "with_nan" in caplog.text and "non-finite" in caplog.text


def test_exception_in_a_reward_is_annotated():
    def broken(prompts, images, **columns):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        resolve_reward_funcs(broken)(["a"], _images(1))
    if sys.version_info >= (3, 11):
        assert any("broken" in note for note in info.value.__notes__)


def test_tensor_and_numpy_outputs_are_accepted():
    import numpy as np

    rs = resolve_reward_funcs([lambda p, i, **c: np.array([1.5] * len(p))])
    assert rs(["a", "b"], _images(2)).total == [1.5, 1.5]


def test_reward_statistics_excludes_none():
    stats = reward_statistics({"a": [1.0, None, 3.0, float("nan")], "b": [None, None]})
    assert stats["rewards/a/mean"] == 2.0 and stats["rewards/a/std"] == 1.0
    assert math.isnan(stats["rewards/b/mean"]) and math.isnan(stats["rewards/b/std"])
    assert set(reward_statistics({"a": [1.0]}, prefix="eval")) == {"eval/a/mean", "eval/a/std"}


def test_concatenate():
    rs = resolve_reward_funcs([prompt_length])
    joined = RewardResult.concatenate([rs(["a"], _images(1)), rs(["abc", "ab"], _images(2))])
    assert joined.per_reward["prompt_length"] == [1.0, 3.0, 2.0] and joined.total == [1.0, 3.0, 2.0]


# ---- asynchronous scoring --------------------------------------------------------------------------


def test_submit_overlaps_with_the_caller_and_keeps_order():
    started = threading.Event()
    release = threading.Event()
    threads = set()

    def slow(prompts, images, **columns):
        threads.add(threading.current_thread().name)
        started.set()
        release.wait(5)
        return [float(len(p)) for p in prompts]

    rs = resolve_reward_funcs([slow, prompt_length], reward_weights=[1.0, 1.0])
    prompts = ["ab"]
    future = rs.submit(prompts, _images(1))
    prompts.append("mutated after submit")  # submit copied its arguments
    assert started.wait(5)
    assert not future.done()  # still scoring while the caller goes on (e.g. samples the next batch)
    second = rs.submit(["abc"], _images(1))
    release.set()
    assert future.result(timeout=5).total == [4.0]
    assert second.result(timeout=5).total == [6.0]
    assert all(name.startswith("flowgrpo-reward") for name in threads)
    rs.close()
    assert rs._pool is None
    # A closed set reopens its pool on demand.
    assert rs.submit(["a"], _images(1)).result(timeout=5).total == [2.0]
    rs.close()


def test_submit_propagates_errors_and_context_manager_closes():
    def broken(prompts, images, **columns):
        raise RuntimeError("scorer crashed")

    with resolve_reward_funcs(broken) as rs:
        future = rs.submit(["a"], _images(1))
        with pytest.raises(RuntimeError, match="scorer crashed"):
            future.result(timeout=5)
        pool = rs._pool
    assert rs._pool is None and pool._shutdown


def test_pool_threads_end_after_close():
    before = {t.name for t in threading.enumerate()}
    rs = RewardSet([prompt_length], ["prompt_length"], num_workers=2)
    futures = [rs.submit(["a"], _images(1)) for _ in range(4)]
    assert [f.result(timeout=5).total for f in futures] == [[1.0]] * 4
    rs.close()
    deadline = time.time() + 5
    while time.time() < deadline:
        extra = {t.name for t in threading.enumerate()} - before
        if not any(n.startswith("flowgrpo-reward") for n in extra):
            break
        time.sleep(0.05)
    assert not any(n.startswith("flowgrpo-reward") for n in {t.name for t in threading.enumerate()} - before)
    with pytest.raises(ValueError, match="num_workers"):
        RewardSet([prompt_length], ["prompt_length"], num_workers=0)


def test_unknown_name_fails_before_anything_is_instantiated():
    built = []

    class Expensive:
        def __init__(self):
            built.append(1)

        def __call__(self, prompts, images, **columns):
            return [0.0] * len(images)

    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward_funcs([Expensive, "nope"])
    assert built == []
    rs = resolve_reward_funcs([Expensive], reward_weights=[np.float32(0.5)])
    assert rs.weights == [0.5] and built == [1]
    assert resolve_reward_funcs(rs) is rs
    with pytest.raises(ValueError, match="already built"):
        resolve_reward_funcs(rs, reward_weights=[1.0])
