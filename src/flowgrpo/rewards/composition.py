"""Resolve reward specifications and combine several rewards into one weighted training reward.

``resolve_reward_funcs(["ocr", my_fn, "my_pkg.rewards:Sharpness"], reward_weights=[1.0, 0.5, 0.1])``
returns a `RewardSet`. Calling it scores a batch with every reward and returns a `RewardResult`:

* ``per_reward[name]``: that reward's scores, one per image, ``None`` where it could not score;
* ``total``: ``sum_k weight_k * score_k`` per image, ``None`` where any component with a non-zero weight is
  ``None`` (a weight-0 reward is logged but does not enter the training reward).

``None`` is "could not score": it is excluded from the statistics (`reward_statistics`) and never counted as 0.
A reward that returns NaN (or +-inf) for an image gets ``None`` there, with a warning.

A reward may return a `RewardOutput` instead of a plain list: still the list of scores, plus per-image ``notes``
(a short text per image, e.g. why GenEval failed it; shown with the logged sample images) and per-image
``metrics`` (``{key: [value or None per image]}``, e.g. the per-task accuracy of GenEval, logged as
``rewards/<name>/<key>``, the mean over the images that have a value). They land in ``RewardResult.notes`` and
``RewardResult.metrics``.

A reward that raises is handled by its ``on_failure`` policy (see `flowgrpo.rewards.failures`): ``"raise"`` (the
default) lets the exception through; ``"skip"`` scores the batch ``None`` for that reward and counts the samples
in ``RewardResult.failed[name]``.

Videos: a sample may be a list of frames (``PIL.Image`` each) instead of one image; a batch holds either images or
videos. A reward written for images scores every frame (one call over all frames of the batch, the other columns
repeated per frame) and a video's score is the mean of its frames' scores (frames it could not score are left out;
``None`` when it scored none). A reward whose callable has ``accepts_video = True`` receives the videos themselves,
one list of frames per sample.

Sound: a reward whose callable has ``accepts_audio = True`` also receives the columns ``audio`` (one float32 numpy
array ``(channels, samples)`` per sample) and ``audio_sampling_rate`` (samples per second, per sample), which the
trainer decodes only when such a reward is present and only for families that generate sound (LTX-2). The other
rewards never see these two columns.

Asynchronous scoring: ``RewardSet.submit(prompts, images, **columns)`` returns a
`concurrent.futures.Future` and scores in a small background thread pool, so that scoring batch k
(OCR on CPU, a CLIP model, an HTTP round trip to a reward server) overlaps with sampling batch k + 1 on
the accelerator. The pool has ``num_workers`` threads (1 by default: batches are scored in submission
order and one at a time, which keeps GPU scorers from competing with each other). Rewards called from the
pool must be thread-safe with respect to the caller's thread; the built-in ones are. The pool is created on
first use and shut down by `RewardSet.close` (also on ``with RewardSet(...)`` exit and at garbage collection).

Group-wise rewards (``pickscore_rank``) score a sample relative to the other samples of its group (the images of
one prompt). Such a reward has ``groupwise = True`` and two methods: ``score_samples(prompts, images, **columns)``
(one raw score per sample) and ``combine_group(scores)`` (one group's raw scores -> its rewards). A direct call of
the `RewardSet` combines within the groups of the ``group_ids`` column (the whole batch is one group without it).
The trainer scores micro-batches, whose groups are incomplete: it calls with ``defer_groupwise=True`` (raw scores)
and, once every process's scores are gathered, `RewardSet.finish_groupwise` combines each full group and recomputes
the totals.

Offloading: with ``offload=True``, every reward that supports it (`flowgrpo.rewards.placement.OffloadableReward`)
has its weights moved to its device for each call and back to the CPU after it.

Reward gradients: a reward whose callable has ``differentiable = True`` also scores the decoded images as a float
tensor ``(N, 3, H, W)`` in [0, 1] and returns a tensor ``(N,)`` that carries the gradient (the interface is in
`flowgrpo.rewards.differentiable`). `RewardSet.score_with_grad` scores such a batch with every reward of non-zero
weight and returns ``total = sum_k weight_k * score_k`` as a tensor, weighted as ``__call__`` weights the PIL scores;
`RewardSet.non_differentiable_rewards` names the rewards it cannot use, which a reward-gradient trainer refuses.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .failures import collect_failed_samples, resolve_on_failure
from .placement import scoring_on_device, supports_offload
from .registry import get_reward, has_reward

logger = logging.getLogger(__name__)

__all__ = ["AUDIO_COLUMNS", "GROUP_IDS_COLUMN", "RewardOutput", "RewardResult", "RewardSet", "TensorRewardResult",
           "accepts_audio", "accepts_video", "combine_in_groups", "is_differentiable", "is_groupwise",
           "resolve_reward_funcs", "reward_spec_names", "reward_statistics"]

#: the column that tells a group-wise reward which samples belong together
GROUP_IDS_COLUMN = "group_ids"

#: the columns of generated sound, given only to the rewards that score it (`accepts_audio`)
AUDIO_COLUMNS = ("audio", "audio_sampling_rate")

RewardSpec = str | Callable[..., Any]


def reward_statistics(
    per_reward: Mapping[str, Sequence[float | None]], prefix: str = "rewards"
) -> dict[str, float]:
    """Mean and (population) std of every reward, ``None`` and NaN excluded.

    Returns ``{f"{prefix}/{name}/mean": ..., f"{prefix}/{name}/std": ...}``; both are NaN for a reward with
    no valid score. ``prefix=""`` gives ``"<name>/mean"``.
    """
    out: dict[str, float] = {}
    head = f"{prefix}/" if prefix else ""
    for name, values in per_reward.items():
        valid = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        if valid:
            mean = math.fsum(valid) / len(valid)
            std = math.sqrt(math.fsum((v - mean) ** 2 for v in valid) / len(valid))
        else:
            mean = std = math.nan
        out[f"{head}{name}/mean"] = mean
        out[f"{head}{name}/std"] = std
    return out


class RewardOutput(list):
    """What a reward may return instead of a plain list: the scores (it *is* that list), plus

    * ``notes``: one short text (or ``None``) per image, shown with the logged sample images;
    * ``metrics``: ``{key: [float | None per image]}``, logged as ``rewards/<reward name>/<key>``: the mean over the
      images with a value (``None`` = this image does not count for that metric).
    """

    def __init__(self, scores: Sequence[float | None], notes: Sequence[str | None] | None = None,
                 metrics: Mapping[str, Sequence[float | None]] | None = None):
        super().__init__(scores)
        n = len(self)
        self.notes: list[str | None] = list(notes) if notes is not None else [None] * n
        self.metrics: dict[str, list[float | None]] = {k: list(v) for k, v in (metrics or {}).items()}
        if len(self.notes) != n:
            raise ValueError(f"RewardOutput has {n} scores but {len(self.notes)} notes")
        for key, values in self.metrics.items():
            if len(values) != n:
                raise ValueError(f"RewardOutput metric {key!r} has {len(values)} values for {n} scores")


def metric_means(sums: Sequence[Mapping[str, tuple[float, int]]]) -> dict[str, float]:
    """Merge ``{key: (sum, count)}`` of several batches or processes (`RewardResult.metric_sums`) into means."""
    total: dict[str, list[float]] = {}
    for part in sums:
        for key, (value, count) in part.items():
            acc = total.setdefault(key, [0.0, 0])
            acc[0] += value
            acc[1] += count
    return {key: (value / count if count else math.nan) for key, (value, count) in total.items()}


@dataclass
class RewardResult:
    """Scores of one batch: every component (``per_reward``) and the weighted ``total``."""

    per_reward: dict[str, list[float | None]]
    total: list[float | None]
    weights: dict[str, float] = field(default_factory=dict)
    #: samples per reward whose scoring failed and were scored None under ``on_failure="skip"``
    failed: dict[str, int] = field(default_factory=dict)
    #: per-image notes of the rewards that give them (`RewardOutput`), by reward name
    notes: dict[str, list[str | None]] = field(default_factory=dict)
    #: per-image metric values of the rewards that give them, keyed ``"<reward name>/<key>"``
    metrics: dict[str, list[float | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.total)

    def statistics(self, prefix: str = "rewards") -> dict[str, float]:
        """Logging statistics, ``None`` excluded: ``"<prefix>/<name>/mean"`` and ``"<prefix>/<name>/std"`` for
        every component (see `reward_statistics`), ``"<prefix>/<name>/failed"`` (samples whose scoring failed),
        plus ``"reward"`` and ``"reward_std"`` for the total."""
        stats = reward_statistics(self.per_reward, prefix)
        head = f"{prefix}/" if prefix else ""
        for name in self.per_reward:
            stats[f"{head}{name}/failed"] = float(self.failed.get(name, 0))
        total = reward_statistics({"total": self.total}, "")
        stats["reward"] = total["total/mean"]
        stats["reward_std"] = total["total/std"]
        for key, mean in metric_means([self.metric_sums()]).items():
            stats[f"{head}{key}"] = mean
        return stats

    def metric_sums(self) -> dict[str, tuple[float, int]]:
        """``{"<reward>/<key>": (sum, count)}`` of the reward-defined metrics, ``None``/NaN left out (merge the sums of
        several processes with `metric_means`)."""
        out = {}
        for key, values in self.metrics.items():
            valid = [float(v) for v in values if v is not None and not math.isnan(float(v))]
            out[key] = (math.fsum(valid), len(valid))
        return out

    def image_notes(self) -> list[str]:
        """One text per image joining the rewards' notes (``"<reward>: <note>"``), ``""`` where none has one."""
        out = []
        for i in range(len(self.total)):
            parts = [f"{name}: {notes[i]}" for name, notes in self.notes.items() if i < len(notes) and notes[i]]
            out.append(" | ".join(parts))
        return out

    @classmethod
    def concatenate(cls, results: Sequence[RewardResult]) -> RewardResult:
        """Join the results of consecutive batches (same rewards) into one."""
        if not results:
            raise ValueError("concatenate needs at least one RewardResult")
        names = list(results[0].per_reward)
        for r in results[1:]:
            if list(r.per_reward) != names:
                raise ValueError(f"cannot concatenate results of different rewards: {names} vs {list(r.per_reward)}")
        return cls(
            per_reward={n: [v for r in results for v in r.per_reward[n]] for n in names},
            total=[v for r in results for v in r.total],
            weights=dict(results[0].weights),
            failed={n: sum(r.failed.get(n, 0) for r in results) for n in names},
            notes={n: [v for r in results for v in r.notes.get(n, [None] * len(r))]
                   for n in dict.fromkeys(k for r in results for k in r.notes)},
            metrics={k: [v for r in results for v in r.metrics.get(k, [None] * len(r))]
                     for k in dict.fromkeys(k for r in results for k in r.metrics)},
        )


@dataclass
class TensorRewardResult:
    """Scores of one batch of image tensors with their gradient (`RewardSet.score_with_grad`).

    ``per_reward[name]``: that reward's float32 tensor ``(N,)`` (NaN where it could not score); ``total``: ``sum_k
    weight_k * score_k`` over the rewards of non-zero weight, NaN where one of them is NaN; ``valid``: where ``total``
    is finite (train on ``total[valid]``: a NaN score carries no gradient path, so masking it out is safe).
    """

    per_reward: dict[str, Any]
    total: Any
    valid: Any
    weights: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.total.shape[0])

    def statistics(self, prefix: str = "rewards") -> dict[str, float]:
        """The logging statistics of `RewardResult.statistics` (NaN left out), from the detached scores."""
        per_reward = {name: _tensor_scores(values) for name, values in self.per_reward.items()}
        stats = reward_statistics(per_reward, prefix)
        total = reward_statistics({"total": _tensor_scores(self.total)}, "")
        stats["reward"] = total["total/mean"]
        stats["reward_std"] = total["total/std"]
        return stats


def _tensor_scores(values: Any) -> list[float | None]:
    return [None if not math.isfinite(v) else v for v in values.detach().float().cpu().tolist()]


def _has_flag(fn: Any, flag: str) -> bool:
    """Whether ``fn`` (or the function a functools.partial wraps, at any depth) has ``flag`` set true."""
    while True:
        if getattr(fn, flag, False):
            return True
        if not hasattr(fn, "func"):
            return False
        fn = fn.func


def accepts_video(fn: Any) -> bool:
    """Whether the reward ``fn`` scores whole videos (``fn.accepts_video = True``, also through functools.partial)."""
    return _has_flag(fn, "accepts_video")


def accepts_audio(fn: Any) -> bool:
    """Whether the reward ``fn`` scores sound (``fn.accepts_audio = True``, also through functools.partial): it then
    receives the ``audio`` and ``audio_sampling_rate`` columns (`AUDIO_COLUMNS`)."""
    return _has_flag(fn, "accepts_audio")


def is_differentiable(fn: Any) -> bool:
    """Whether the reward ``fn`` also scores image tensors with gradient (``fn.differentiable = True``, also through
    functools.partial; see `flowgrpo.rewards.differentiable`)."""
    return _has_flag(fn, "differentiable")


def is_groupwise(fn: Any) -> bool:
    """Whether the reward ``fn`` is group-wise (``fn.groupwise = True``, also through functools.partial)."""
    return _has_flag(fn, "groupwise")


def _unwrap_groupwise(fn: Any) -> Any:
    while not getattr(fn, "groupwise", False) and hasattr(fn, "func"):
        fn = fn.func
    return fn


def combine_in_groups(fn: Any, scores: Sequence[float | None], group_ids: Sequence[Any] | None
                      ) -> list[float | None]:
    """Apply the group-wise reward ``fn``'s ``combine_group`` to the scores of each group (samples with the same
    ``group_ids`` value, in their order; all samples form one group when ``group_ids`` is None)."""
    fn = _unwrap_groupwise(fn)
    scores = list(scores)
    if group_ids is None:
        return list(fn.combine_group(scores))
    group_ids = list(group_ids)
    if len(group_ids) != len(scores):
        raise ValueError(f"{len(group_ids)} group ids for {len(scores)} scores")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out: list[float | None] = [None] * len(scores)
    for idx in members.values():
        combined = list(fn.combine_group([scores[i] for i in idx]))
        if len(combined) != len(idx):
            raise ValueError(f"combine_group returned {len(combined)} rewards for a group of {len(idx)}")
        for i, v in zip(idx, combined):
            out[i] = v
    return out


def _is_video(sample: Any) -> bool:
    return isinstance(sample, (list, tuple))


def _callable_name(fn: Any) -> str:
    inner = fn
    while hasattr(inner, "func") and not hasattr(inner, "__name__"):  # functools.partial
        inner = inner.func
    name = getattr(inner, "__name__", None)
    if not name:
        name = type(inner).__name__
    return name


def _load_dotted(path: str, kwargs: Mapping[str, Any]) -> tuple[str, Callable]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward path {path!r} must look like 'package.module:function' (or ':Class')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward path {path!r}: cannot import module {module_name!r} ({e})") from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"reward path {path!r}: {module_name!r} has no attribute {attr!r}") from None
    return attr.split(".")[-1], _instantiate(obj, kwargs, path)


def _instantiate(obj: Any, kwargs: Mapping[str, Any], label: str) -> Callable:
    if isinstance(obj, type):
        return obj(**kwargs)
    if not callable(obj):
        raise TypeError(f"reward {label!r} is a {type(obj).__name__}, not a function or a class")
    if kwargs:
        import functools

        bound = functools.partial(obj, **kwargs)
        try:
            functools.update_wrapper(bound, obj)
        except AttributeError:
            pass
        return bound
    return obj


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            candidate = f"{n}_{seen[n]}"
            while candidate in seen:
                seen[n] += 1
                candidate = f"{n}_{seen[n]}"
            seen[candidate] = 1
            out.append(candidate)
        else:
            seen[n] = 1
            out.append(n)
    return out


def _spec_name(spec: Any) -> str:
    if isinstance(spec, str):
        return spec.partition(":")[2].split(".")[-1] if ":" in spec else spec
    return _callable_name(spec)


def reward_spec_names(reward_funcs: RewardSpec | Sequence[RewardSpec]) -> list[str]:
    """The names `resolve_reward_funcs` gives ``reward_funcs`` (a `RewardSet`: its names), without instantiating
    anything."""
    if isinstance(reward_funcs, RewardSet):
        return list(reward_funcs.names)
    specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    return _unique([_spec_name(s) for s in specs])


def resolve_reward_funcs(
    reward_funcs: RewardSpec | Sequence[RewardSpec],
    reward_weights: Sequence[float] | None = None,
    reward_kwargs: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any] | None] | None = None,
    num_workers: int = 1,
    on_failure: str | Mapping[str, str] | None = None,
    offload: bool = False,
) -> RewardSet:
    """Turn reward specifications into a `RewardSet`.

    Args:
        reward_funcs: one specification or a list of them (a `RewardSet` is returned as is). A
            specification is a registry name (``"ocr"``), a ``"package.module:function"`` or
            ``"package.module:Class"`` path (a class is instantiated), a callable, or a class (instantiated).
            Names: the registry name, the attribute name of a path, a callable's ``__name__`` (its class name
            for instances); repeated names get ``_2``, ``_3``...
        reward_weights: one weight per reward (default 1.0 each); the weighted sum is the training reward.
        reward_kwargs: constructor / keyword arguments per reward, either a mapping keyed by the reward's
            specification string or name (``{"ocr": {"backend": "rapidocr"}}``) or a list aligned with
            ``reward_funcs``. Keys that match no reward are an error (they are usually typos).
        num_workers: threads of the background pool used by `RewardSet.submit`.
        on_failure: what a reward that raises does to a batch: ``"raise"`` (default) or ``"skip"`` (``"none"``
            is the same), one policy for all or a ``{name: policy}`` mapping (see `flowgrpo.rewards.failures`).
        offload: keep the weights of every reward that supports it on the CPU between calls (``reward_offload``).

    Raises:
        ValueError: empty list, unknown name (the message lists the registered ones), bad path, weights or
            kwargs of the wrong length, or kwargs for a reward that is not in the list.
    """
    if isinstance(reward_funcs, RewardSet):
        if reward_weights is not None or reward_kwargs is not None:
            raise ValueError("reward_weights / reward_kwargs cannot be applied to an already built RewardSet")
        if on_failure is not None:
            reward_funcs.on_failure = resolve_on_failure(on_failure, reward_funcs.names)
        if offload:
            reward_funcs.offload = True
        return reward_funcs
    specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not specs:
        raise ValueError("reward_funcs is empty; give at least one reward name, path or callable")
    for s in specs:
        if not (isinstance(s, str) or callable(s)):
            raise TypeError(f"reward {s!r} is a {type(s).__name__}; expected a name, a 'module:function' path "
                            f"or a callable")

    if reward_weights is None:
        weights = [1.0] * len(specs)
    else:
        weights = list(reward_weights)
        if len(weights) != len(specs):
            raise ValueError(f"reward_weights has {len(weights)} entries but reward_funcs has {len(specs)}; "
                             f"give one weight per reward")
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
                raise ValueError(f"reward weight {w!r} is not a finite number")
        weights = [float(w) for w in weights]

    # Unknown registry names fail before anything is instantiated (importing only the plugins that provide them).
    for s in specs:
        if isinstance(s, str) and ":" not in s and not has_reward(s):
            get_reward(s)  # raises ValueError listing the registered names

    # Names before instantiation, so that kwargs can be matched and errors come before any model loads.
    base_names = [_spec_name(s) for s in specs]
    names = _unique(base_names)
    policies = resolve_on_failure(on_failure, names)  # a bad policy fails before anything is instantiated

    per_kwargs: list[dict[str, Any]]
    if reward_kwargs is None:
        per_kwargs = [{} for _ in specs]
    elif isinstance(reward_kwargs, Mapping):
        keys = {}
        for i, s in enumerate(specs):
            for key in {names[i], base_names[i]} | ({s} if isinstance(s, str) else set()):
                keys.setdefault(key, []).append(i)
        unknown = [k for k in reward_kwargs if k not in keys]
        if unknown:
            raise ValueError(f"reward_kwargs has entries for {unknown} but the rewards are {names}")
        per_kwargs = [{} for _ in specs]
        for key, kw in reward_kwargs.items():
            if kw is None:
                continue
            if not isinstance(kw, Mapping):
                raise ValueError(f"reward_kwargs[{key!r}] must be a mapping of keyword arguments, got {kw!r}")
            for i in keys[key]:
                per_kwargs[i].update(kw)
    else:
        kw_list = list(reward_kwargs)
        if len(kw_list) != len(specs):
            raise ValueError(f"reward_kwargs has {len(kw_list)} entries but reward_funcs has {len(specs)}")
        per_kwargs = [dict(kw or {}) for kw in kw_list]

    funcs: list[Callable] = []
    for s, kw in zip(specs, per_kwargs):
        if isinstance(s, str):
            if ":" in s:
                funcs.append(_load_dotted(s, kw)[1])
            else:
                funcs.append(get_reward(s, **kw))
        else:
            funcs.append(_instantiate(s, kw, _callable_name(s)))
    return RewardSet(funcs, names, weights, num_workers=num_workers, on_failure=policies, offload=offload)


def _shutdown_pool(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=False, cancel_futures=True)


class RewardSet:
    """Several named, weighted rewards scored together. Usually built by `resolve_reward_funcs`.

    ``reward_set(prompts, images, **columns)`` scores synchronously; ``reward_set.submit(...)`` scores in
    the background pool and returns a ``Future[RewardResult]``. ``columns`` are the dataset's other columns,
    lists aligned with ``prompts``; each reward receives all of them.
    """

    def __init__(
        self,
        funcs: Sequence[Callable],
        names: Sequence[str],
        weights: Sequence[float] | None = None,
        num_workers: int = 1,
        on_failure: str | Mapping[str, str] | None = None,
        offload: bool = False,
    ):
        self.funcs = list(funcs)
        self.offload = bool(offload)
        self.names = list(names)
        self.weights = [1.0] * len(self.funcs) if weights is None else [float(w) for w in weights]
        if not (len(self.funcs) == len(self.names) == len(self.weights)):
            raise ValueError(f"{len(self.funcs)} rewards, {len(self.names)} names and {len(self.weights)} weights; "
                             f"they must match")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward names must be unique, got {self.names}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = int(num_workers)
        self.on_failure: dict[str, str] = resolve_on_failure(on_failure, self.names)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def __len__(self) -> int:
        return len(self.funcs)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}*{w:g}" for n, w in zip(self.names, self.weights))
        return f"RewardSet({parts})"

    # ---- scoring ---------------------------------------------------------------------------------

    @property
    def audio_rewards(self) -> list[str]:
        """The names of the rewards that score sound (`accepts_audio`)."""
        return [name for name, fn in zip(self.names, self.funcs) if accepts_audio(fn)]

    @property
    def has_groupwise(self) -> bool:
        """Whether a reward of the set is group-wise."""
        return any(is_groupwise(fn) for fn in self.funcs)

    # ---- scoring with gradient -------------------------------------------------------------------

    @property
    def differentiable_rewards(self) -> list[str]:
        """The names of the rewards that score image tensors with gradient (`is_differentiable`, not group-wise)."""
        return [name for name, fn in zip(self.names, self.funcs) if is_differentiable(fn) and not is_groupwise(fn)]

    @property
    def non_differentiable_rewards(self) -> list[str]:
        """The names of the rewards of non-zero weight that give no gradient: not `is_differentiable`, or group-wise
        (a rank has no gradient). `score_with_grad` refuses a set that has any; a weight-0 reward never enters the
        gradient and is not listed (it is scored on the PIL path only, for logging)."""
        usable = set(self.differentiable_rewards)
        return [name for name, w in zip(self.names, self.weights) if w != 0.0 and name not in usable]

    def require_differentiable(self, user: str = "RewardSet.score_with_grad") -> None:
        """Raise a ValueError naming the rewards of non-zero weight that ``user`` cannot backpropagate through.

        Raises:
            ValueError: `non_differentiable_rewards` is not empty, or no reward has a non-zero weight.
        """
        bad = self.non_differentiable_rewards
        if bad:
            usable = self.differentiable_rewards
            raise ValueError(
                f"{user} backpropagates the reward into the images, but the reward(s) {bad} are not differentiable "
                f"(they score PIL images only, or rank within groups). Remove them from reward_funcs or give them "
                f"reward_weights 0 (logged, not trained on)"
                + (f"; the differentiable ones here are {usable}" if usable else "")
                + ". Differentiable rewards declare `differentiable = True` and accept a float tensor (N, 3, H, W) in "
                  "[0, 1] (docs/rewards.md, 'Differentiable rewards').")
        if not any(w != 0.0 for w in self.weights):
            raise ValueError(f"{user}: every reward of {self!r} has weight 0, so there is nothing to backpropagate; give "
                             f"a differentiable reward a non-zero weight")

    def score_with_grad(self, prompts: Sequence[str], images: Any, **columns: Sequence[Any]) -> TensorRewardResult:
        """Score a batch of decoded images given as a float tensor ``(N, 3, H, W)`` in [0, 1] with every reward of
        non-zero weight, keeping the gradient with respect to ``images``.

        Returns a `TensorRewardResult`: each reward's tensor ``(N,)`` and ``total = sum_k weight_k * score_k`` (the
        weighting of ``__call__``), NaN where a reward could not score (``valid`` is False there). ``columns`` are the
        dataset's other columns, as for ``__call__``. Every reward must be differentiable (`require_differentiable`);
        the ``on_failure`` policy does not apply here: a reward that raises fails the call. With ``offload=True`` the
        weights move to their device here and stay there for the backward pass; `offload_rewards` moves them back.

        Raises:
            TypeError: ``images`` is not a tensor (PIL images are scored by ``__call__``).
            ValueError: a reward of non-zero weight is not differentiable; misaligned prompts, images or columns.
        """
        import torch

        from .differentiable import check_image_tensor, check_score_tensor, is_image_tensor

        if not is_image_tensor(images):
            raise TypeError(f"score_with_grad scores a float tensor (N, 3, H, W) in [0, 1], got "
                            f"{type(images).__name__}; score PIL images by calling the RewardSet")
        self.require_differentiable()
        prompts = list(prompts)
        n = len(prompts)
        check_image_tensor(images, n, "RewardSet")
        cols = self._aligned_columns(columns, n)
        without_audio = {k: v for k, v in cols.items() if k not in AUDIO_COLUMNS}
        per_reward: dict[str, Any] = {}
        total = torch.zeros(n, dtype=torch.float32, device=images.device)
        for name, fn, weight in zip(self.names, self.funcs, self.weights):
            if weight == 0.0:
                continue
            try:
                if self.offload and supports_offload(fn):
                    fn.to()  # stays on its device until `offload_rewards`: the backward pass still needs the weights
                raw = fn(prompts, images, **(cols if accepts_audio(fn) else without_audio))
            except Exception as e:
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"while computing reward {name!r} with gradient")
                raise
            scores = check_score_tensor(raw, n, name).to(images.device)
            per_reward[name] = scores
            total = total + weight * scores
        return TensorRewardResult(per_reward=per_reward, total=total, valid=torch.isfinite(total),
                                  weights=dict(zip(self.names, self.weights)))

    def offload_rewards(self) -> None:
        """Move the weights of every reward that supports it back to the CPU (with ``offload=True``, call it after the
        backward pass that follows `score_with_grad`, which leaves them on their device for that pass)."""
        moved = False
        for fn in self.funcs:
            if supports_offload(fn):
                fn.offload()
                moved = True
        if moved:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @staticmethod
    def _aligned_columns(columns: Mapping[str, Sequence[Any]], n: int) -> dict[str, list[Any]]:
        cols = {}
        for key, values in columns.items():
            values = list(values)
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values but there are {n} prompts")
            cols[key] = values
        return cols

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], *, defer_groupwise: bool = False,
                 **columns: Sequence[Any]) -> RewardResult:
        """Score a batch of images (or of videos: lists of frames) with every reward; see the module docstring for
        videos, ``None``, the total and group-wise rewards (``defer_groupwise=True``: their raw per-sample scores,
        to be combined later by `finish_groupwise`)."""
        prompts = list(prompts)
        images = list(images)
        n = len(prompts)
        if len(images) != n:
            raise ValueError(f"{n} prompts but {len(images)} images; they must be aligned")
        cols = self._aligned_columns(columns, n)
        videos = [_is_video(im) for im in images]
        is_video = bool(videos) and all(videos)
        if any(videos) and not is_video:
            raise ValueError("a batch mixes images and videos (lists of frames); score them in separate batches")
        per_reward: dict[str, list[float | None]] = {}
        failed: dict[str, int] = {}
        notes: dict[str, list[str | None]] = {}
        metrics: dict[str, list[float | None]] = {}
        without_audio = {k: v for k, v in cols.items() if k not in AUDIO_COLUMNS}
        for name, fn in zip(self.names, self.funcs):
            groupwise = is_groupwise(fn)
            scorer = _unwrap_groupwise(fn).score_samples if groupwise else fn
            reward_cols = cols if accepts_audio(fn) else without_audio
            with collect_failed_samples() as reported:
                try:
                    frame_scores = None
                    with scoring_on_device(_unwrap_groupwise(fn), self.offload):
                        if is_video and not accepts_video(fn):
                            frame_scores = self._score_frames(name, scorer, prompts, images, reward_cols)
                        else:
                            raw = scorer(prompts, images, **reward_cols)
                except Exception as e:
                    if self.on_failure.get(name, "raise") != "skip":
                        if hasattr(e, "add_note"):  # Python >= 3.11
                            e.add_note(f"while computing reward {name!r}")
                        raise
                    logger.warning("reward %r raised %s: %s; its %d sample(s) in this batch score None "
                                   "(on_failure='skip')", name, type(e).__name__, e, n)
                    per_reward[name] = [None] * n
                    failed[name] = n
                    continue
            per_reward[name] = frame_scores if frame_scores is not None else self._check_scores(name, raw, n)
            if groupwise and not defer_groupwise:
                per_reward[name] = self._check_scores(
                    name, combine_in_groups(fn, per_reward[name], cols.get(GROUP_IDS_COLUMN)), n)
            failed[name] = min(n, sum(reported))
            if frame_scores is None and isinstance(raw, RewardOutput):
                notes[name] = list(raw.notes)
                metrics.update({f"{name}/{key}": list(values) for key, values in raw.metrics.items()})
        return RewardResult(per_reward=per_reward, total=self.weighted_total(per_reward, n),
                            weights=dict(zip(self.names, self.weights)), failed=failed, notes=notes, metrics=metrics)

    def weighted_total(self, per_reward: Mapping[str, Sequence[float | None]], n: int) -> list[float | None]:
        """``sum_k weight_k * score_k`` per sample; None where a component with a non-zero weight is None."""
        total: list[float | None] = []
        for i in range(n):
            acc = 0.0
            for name, w in zip(self.names, self.weights):
                v = per_reward[name][i]
                if w == 0.0:
                    continue
                if v is None:
                    acc = None
                    break
                acc += w * v
            total.append(acc)
        return total

    def finish_groupwise(self, per_reward: Mapping[str, Sequence[float | None]], group_ids: Sequence[Any]
                         ) -> tuple[dict[str, list[float | None]], list[float | None]]:
        """Combine the deferred raw scores of the group-wise rewards within complete groups.

        ``per_reward`` holds every reward's scores of whole groups (e.g. gathered from all processes) and
        ``group_ids`` the group of each sample. Returns the per-reward scores (group-wise ones combined, others
        unchanged) and the recomputed weighted totals.
        """
        group_ids = list(group_ids)
        out: dict[str, list[float | None]] = {}
        for name, fn in zip(self.names, self.funcs):
            values = [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
                      for v in per_reward[name]]
            out[name] = self._check_scores(name, combine_in_groups(fn, values, group_ids), len(values)) \
                if is_groupwise(fn) else values
        return out, self.weighted_total(out, len(group_ids))

    @classmethod
    def _score_frames(cls, name: str, fn: Callable, prompts: list[str], videos: list[Sequence[Any]],
                      cols: dict[str, list[Any]]) -> list[float | None]:
        """An image reward on videos: every frame scored (one call), each video's score the mean of its frames'."""
        owner = [i for i, frames in enumerate(videos) for _ in frames]
        frames = [frame for video in videos for frame in video]
        frame_cols = {k: [v[i] for i in owner] for k, v in cols.items()}
        scores = cls._check_scores(name, fn([prompts[i] for i in owner], frames, **frame_cols), len(frames))
        per_video: list[list[float]] = [[] for _ in videos]
        for i, score in zip(owner, scores):
            if score is not None:
                per_video[i].append(score)
        return [math.fsum(v) / len(v) if v else None for v in per_video]

    @staticmethod
    def _check_scores(name: str, raw: Any, n: int) -> list[float | None]:
        if hasattr(raw, "tolist") and not isinstance(raw, list):  # tensors, numpy arrays
            raw = raw.tolist()
        if not isinstance(raw, (list, tuple)):
            raise TypeError(f"reward {name!r} returned a {type(raw).__name__}; expected a list of {n} scores")
        if len(raw) != n:
            raise ValueError(f"reward {name!r} returned {len(raw)} scores for {n} images")
        out: list[float | None] = []
        bad = 0
        for i, v in enumerate(raw):
            if v is None:
                out.append(None)
                continue
            if isinstance(v, bool):
                raise TypeError(f"reward {name!r} returned a bool for image {i}; expected a number or None")
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"reward {name!r} returned {v!r} for image {i}; expected a number or None") from None
            if math.isfinite(f):
                out.append(f)
            else:
                bad += 1
                out.append(None)
        if bad:
            logger.warning("reward %r returned %d non-finite score(s) (NaN/inf) out of %d; treating them as "
                           "unscored (None)", name, bad, n)
        return out

    # ---- asynchronous scoring ----------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                from ..cpu_threads import limit_worker_threads

                self._pool = ThreadPoolExecutor(max_workers=self.num_workers, thread_name_prefix="flowgrpo-reward",
                                                initializer=limit_worker_threads)
                self._finalizer = weakref.finalize(self, _shutdown_pool, self._pool)
            return self._pool

    def submit(self, prompts: Sequence[str], images: Sequence[Any], *, defer_groupwise: bool = False,
               **columns: Sequence[Any]) -> Future[RewardResult]:
        """Score in the background pool; returns a Future of the `RewardResult` (``defer_groupwise``: see
        ``__call__``).

        The arguments are copied into new lists at once, so the caller may reuse its buffers. Exceptions
        raised by a reward surface from ``future.result()``.
        """
        args = (list(prompts), list(images))
        cols = {k: list(v) for k, v in columns.items()}
        from ..cpu_threads import background_task

        return self._executor().submit(background_task, self.__call__, *args, defer_groupwise=defer_groupwise, **cols)

    def close(self, wait: bool = True) -> None:
        """Shut the background pool down (pending batches are cancelled when ``wait=False``)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
