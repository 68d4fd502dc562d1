"""``train_timesteps_per_pass``: the trained timesteps of a micro-batch replayed in one forward and one backward.

For every trainer kind of the shared cases (AWM aside, see ``KINDS``), DiffusionNFT, and Flow-GRPO's DanceGRPO /
GRPO-Guard settings with a KL term (MixGRPO only moves the recorded window, which the replay does not see), three
optimizer steps with every part of a micro-batch in one pass (``all``) end at the LoRA weights of the part-by-part
run (``1``) within 1e-5, float32 on one CPU thread; the trained transformer really ran one forward a micro-batch,
and Flow-GRPO's first-pass ratio is exactly 1. The optimizer is plain SGD with a large step: its update is the
gradient times the learning rate, so a changed scale of the loss (which Adam's normalised update would hide) or a part
trained on another part's rows moves the weights far beyond the tolerance (the runs move them by more than 5e-4).
Micro-batches have 4 images: on this CPU a linear layer run on 3 rows or fewer takes another kernel, whose rows
differ in the last bit from a larger batch's (docs/benchmarks.md, "The cost of a step"). The grouping and the
refusals are checked without a model.
"""

from __future__ import annotations

import gc

import pytest
import torch
from support.trainer_cases import TRAINER_KINDS, make_trainer, redness_reward

from flowgrpo import FlowGRPOConfig
from flowgrpo.trainer.timestep_passes import (
    even_timesteps_per_pass,
    parse_timesteps_per_pass,
    passes_of,
    split_rows,
    stack_rows,
)

#: settings that give each kind several parts per micro-batch (besides its shared case's): Diffusion-DPO's draws,
#: DiffusionNFT's noise levels, and Flow-GRPO's variants that change which steps are trained and how
PARTS = {
    "diffusion_dpo": dict(dpo_num_noise_draws=2),
    "diffusion_nft": dict(timestep_fraction=0.75),
    "branch_grpo": dict(branch_steps=[0]),  # trees of two leaves: this test's groups of two images
    "flow_grpo_variants": dict(sde_type="dance", noise_level=0.3, same_noise_per_group=True, timestep_fraction=0.7,
                               sde_window_size=0, ratio_normalization="grpo_guard", beta=0.01),
    # TempFlow-GRPO: a micro-batch of 4 holds the children of two branch steps, each step a part of its own rows
    "tempflow": dict(tempflow_children=2, tempflow_branch_steps=[0, 1], num_generations=4),
}
#: AWM is left out: its micro-batch is one part (its train_timesteps levels already share one forward), so K groups
#: nothing there and both runs are the same code; the reward-gradient trainer refuses K != 1 (its parts are whole
#: sampling chains, backpropagated one at a time; tests/trainer/algorithms/test_reward_backprop.py)
KINDS = {**{kind: (kind, TRAINER_KINDS[kind][2]) for kind in TRAINER_KINDS if kind not in ("awm", "reward_backprop")},
         "diffusion_nft": ("diffusion_nft", {}),
         "flow_grpo_variants": ("flow_grpo", {}),
         "tempflow": ("flow_grpo", {})}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def frozen_gc():
    """The objects alive before these tests kept out of the garbage collector's scans: Trainer.train() starts with a
    full collection (accelerate's free_memory), which otherwise walks every object of the test process (0.4 s a
    run here); nothing the trainers do changes."""
    gc.freeze()
    yield
    gc.unfreeze()


def _trained_forwards(trainer) -> list[int]:
    """A counter of the trained transformer's forwards run with gradient (the training passes)."""
    count = [0]

    def hook(module, args):
        if torch.is_grad_enabled():
            count[0] += 1

    for module in trainer.policy.adapter.transformers():
        module.register_forward_pre_hook(hook)
    return count


@pytest.mark.parametrize("case", list(KINDS))
def test_one_pass_trains_the_weights_of_one_timestep_per_pass(tiny_sd3_path, tmp_path, one_thread, frozen_gc, case):
    kind, settings = KINDS[case]
    settings = {**settings, **PARTS.get(case, {})}
    settings.pop("train_timesteps_per_pass", None)  # set here
    weights, forwards = {}, {}
    for setting in (1, "all"):
        # plain SGD: an update proportional to the gradient shows any change of the loss's scale, which Adam hides
        run = {"per_device_train_batch_size": 4, "num_generations": 2, **settings}
        trainer = make_trainer(tiny_sd3_path, tmp_path / str(setting), kind=kind, reward=redness_reward, max_steps=3,
                               optim="sgd", learning_rate=10.0, weight_decay=0.0, seed=3, resolution=32,
                               max_sequence_length=8, train_timesteps_per_pass=setting, **run)
        start = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
        count = _trained_forwards(trainer)
        trainer.train()
        weights[setting] = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
        forwards[setting] = count[0]
        first = next(h for h in trainer.state.log_history if "loss" in h)
        if "on_policy_ratio_max_dev" in first:  # each row gets the one-row-batch result: the ratio is exactly 1
            assert first["on_policy_ratio_max_dev"] == 0.0, (setting, first["on_policy_ratio_max_dev"])
    moved = max(float((a - b).abs().max()) for a, b in zip(weights[1], start))
    changed = max(float((a - b).abs().max()) for a, b in zip(weights[1], weights["all"]))
    assert moved > 5e-4, f"{case}: the weights moved by {moved:.3g} only"
    assert changed <= 1e-5, f"{case}: K = all moved the LoRA weights by {changed:.3g} from K = 1"
    # three optimizer steps of one micro-batch each: one trained forward a micro-batch at K = all, one a part at 1
    assert forwards["all"] == 3, forwards
    assert forwards[1] > 3, forwards


def test_passes_group_the_parts():
    assert passes_of(5, 1) == [[0], [1], [2], [3], [4]]
    assert passes_of(5, 2) == [[0, 1], [2, 3], [4]]
    assert passes_of(5, "all") == [[0, 1, 2, 3, 4]]
    assert passes_of(3, 8) == [[0, 1, 2]]
    assert [even_timesteps_per_pass(9, k) for k in (1, 2, 4, 5, 6, 8, 9, 12)] == [1, 2, 3, 5, 5, 5, 9, 9]
    rows = [torch.full((2, 3), float(i)) for i in range(3)]
    stacked = stack_rows(rows)
    assert stacked.shape == (6, 3)
    assert all(torch.equal(a, b) for a, b in zip(split_rows(stacked, [2, 2, 2]), rows))
    assert stack_rows(rows[:1]) is rows[0] and split_rows(rows[0], [2])[0] is rows[0]


@pytest.mark.parametrize("value, parsed", [(1, 1), ("4", 4), (" ALL ", "all"), (3.0, 3)])
def test_setting_parses(value, parsed):
    assert parse_timesteps_per_pass(value) == parsed


@pytest.mark.parametrize("value", [0, -2, "some", 1.5, True, None])
def test_bad_setting_is_refused_with_the_fix(tmp_path, value):
    with pytest.raises(ValueError, match=r"train_timesteps_per_pass=.*(whole number >= 1|'all')"):
        FlowGRPOConfig(output_dir=str(tmp_path), train_timesteps_per_pass=value)
