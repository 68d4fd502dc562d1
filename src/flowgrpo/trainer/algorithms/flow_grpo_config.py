"""FlowGRPOConfig: every knob of Flow-GRPO training, as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares (groups, rollouts, rewards, memory, crash safety, logging) are those of
`OnlineRLConfig`; this class adds Flow-GRPO's own: the stochastic sampler (noise level, SDE or CPS), its windows
and solvers, and the clipped-ratio objective. Defaults follow the published Flow-GRPO recipes for Stable Diffusion
3.5 Medium where they exist (LoRA r=32/alpha=64, lr 3e-4, noise level 0.7, KL weight 0.04, clip range 1e-4,
advantage clip 5); each field's help says where its default comes from. The sampling settings (size, steps, guidance,
text length) are the model's own unless given (the published SD3.5-M ones, 512 px, 10 steps, 40 for evaluation, CFG
4.5, are in ``recipes/ocr.yaml`` and its siblings).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..algorithm_spec import AlgorithmFacts, AlgorithmSpec, PlannedStep, RolloutRecord, TransitionProbe, WorkerNeeds
from ..config_docs import document_config
from ..online_config import DTYPES, QUANTIZATIONS, REWARD_AGGREGATIONS, SCALE_REWARDS, OnlineRLConfig, check_choice
from .branch_grpo import BRANCH_PRUNINGS, BRANCH_WIDTH_MODES, SPLIT_LOG_PROBS, check_branch_steps

SDE_TYPES = ("sde", "cps", "dance")
SDE_WINDOW_STRATEGIES = ("random", "progressive", "fixed")
ODE_SOLVERS = ("euler", "dpmpp_2m")
#: the objective's choices (flow_grpo_loss.py implements them)
RATIO_NORMALIZATIONS = ("none", "grpo_guard")
KL_ESTIMATORS = ("analytic", "k1", "k3", "velocity")
POLICY_LOSSES = ("clip", "dppo")
BRANCH_SPLIT_LOG_PROBS = SPLIT_LOG_PROBS

__all__ = ["BRANCH_PRUNINGS", "BRANCH_SPLIT_LOG_PROBS", "BRANCH_WIDTH_MODES", "DTYPES", "KL_ESTIMATORS", "ODE_SOLVERS",
           "POLICY_LOSSES", "QUANTIZATIONS", "RATIO_NORMALIZATIONS", "REWARD_AGGREGATIONS", "SCALE_REWARDS", "SDE_TYPES",
           "SDE_WINDOW_STRATEGIES", "SPEC", "FlowGRPOConfig", "describe_flow_grpo", "last_recorded_step",
           "recorded_steps"]


@document_config
@dataclass
class FlowGRPOConfig(OnlineRLConfig):
    r"""Configuration for [`FlowGRPOTrainer`]: the shared settings of [`OnlineRLConfig`] (groups and batches,
    rollouts, rewards, memory, crash safety, logging) plus Flow-GRPO's stochastic sampler and clipped objective.
    """

    # ---- the stochastic sampler and its windows -----------------------------------------------------
    noise_level: float = field(
        default=0.7,
        metadata={"help": "SDE noise level a (Flow-GRPO: 0.7). For 'sde' the step std is a*sqrt(sigma/(1-sigma))*"
                          "sqrt(-dt); for 'cps' it is sigma' * sin(a*pi/2). 0 gives deterministic ODE sampling, "
                          "which cannot be trained."},
    )
    sde_type: str = field(
        default="sde",
        metadata={"help": "Stochastic sampler: 'sde' (Flow-GRPO's marginal-preserving reverse SDE), 'cps' "
                          "(coefficients-preserving sampling, suited to few steps) or 'dance' (DanceGRPO's step: "
                          "std = a*sqrt(sigma - sigma'), mean = x + dt*(v - a^2/2*score); recipes use a = 0.3)."},
    )
    sde_window_size: int = field(
        default=0,
        metadata={"help": "Flow-GRPO-Fast / MixGRPO windows: number of consecutive SDE steps per rollout; ODE "
                          "elsewhere, and only the window's steps are stored and trained. 0 = SDE on every step "
                          "but the last (plain Flow-GRPO)."},
    )
    sde_window_range: list[int] | None = field(
        default=None,
        metadata={"help": "Two integers [lo, hi): the window starts lo .. hi - 1 that sde_window_strategy chooses "
                          "from; windows end before the last step. Defaults to [0, min(num_inference_steps // 2, "
                          "num_inference_steps - sde_window_size)] for 'random' and to every window that ends "
                          "before the last step, [0, num_inference_steps - sde_window_size), for 'progressive' "
                          "and 'fixed'."},
    )
    sde_window_strategy: str = field(
        default="random",
        metadata={"help": "Where each rollout's SDE window starts: 'random' (Flow-GRPO-Fast: uniform over "
                          "sde_window_range, drawn per generation from the seed), 'progressive' (MixGRPO: at 0-based "
                          "optimizer step k the start is lo + (k // sde_window_shift_interval) * sde_window_stride, "
                          "then back to lo or staying at the last start, see sde_window_roll_back) or 'fixed' (always "
                          "lo). All three are functions of the step and the seed, so resuming continues them."},
    )
    sde_window_shift_interval: int = field(
        default=25,
        metadata={"help": "Progressive windows: optimizer steps between two moves of the window (MixGRPO: 25)."},
    )
    sde_window_stride: int = field(
        default=1, metadata={"help": "Progressive windows: sampling steps the window moves each time (MixGRPO: 1)."},
    )
    sde_window_roll_back: bool = field(
        default=True,
        metadata={"help": "Progressive windows: after the last valid start go back to the first one (MixGRPO's "
                          "default); false stays at the last start."},
    )
    ode_solver: str = field(
        default="euler",
        metadata={"help": "Solver of the deterministic steps outside the SDE window: 'euler' or 'dpmpp_2m' "
                          "(DPM-Solver++ 2M in lambda = log((1 - sigma) / sigma) on the data prediction "
                          "x0 = x - sigma v; first order on the first step of each deterministic stretch and on "
                          "the final step; MixGRPO-Flash). The window's steps and log-probs do not change."},
    )
    ode_compression_ratio: float = field(
        default=1.0,
        metadata={"help": "In (0, 1]; with ode_solver='dpmpp_2m', the n steps after the window are replaced by "
                          "max(1, int(n * ratio)) solver steps over the same noise range (MixGRPO-Flash: 0.4). "
                          "1.0 keeps every step."},
    )
    same_noise_per_group: bool = field(
        default=False,
        metadata={"help": "Start the G samples of a prompt from the same initial noise (MixGRPO's default); the "
                          "SDE noise inside the window still differs per sample. The noise is a function of the "
                          "seed, the generation and the prompt's dataset index, so a group split over micro-batches "
                          "or processes shares it."},
    )

    timestep_fraction: float = field(
        default=1.0,
        metadata={"help": "In (0, 1]: each sample trains a random int(steps * timestep_fraction) of its recorded SDE "
                          "steps (at least 1), drawn per sample from the seed and the micro-step (DanceGRPO: 0.6 of "
                          "its 16 steps). 1.0 trains every recorded step in order."},
    )

    # ---- the clipped objective -----------------------------------------------------------------------
    epsilon: float = field(
        default=1e-4,
        metadata={"help": "PPO clip range of the likelihood ratio. Flow-GRPO: 1e-4 (tuned for mean-reduced "
                          "log-probs)."},
    )
    ratio_normalization: str = field(
        default="none",
        metadata={"help": "Likelihood ratio of the clipped objective: 'none' (the exact Gaussian ratio) or "
                          "'grpo_guard' (GRPO-Guard: log ratio = mean over the non-batch dims of "
                          "eps * (mu_theta - mu_old), eps = (x' - mu_old) / std, which removes the downward bias of "
                          "the exact ratio and its per-step 1/std scale). 0 on-policy either way."},
    )
    kl_estimator: str = field(
        default="analytic",
        metadata={"help": "KL penalty to the reference (with beta > 0): 'analytic' (mean((mu_theta - mu_ref)^2) / "
                          "(2 std^2) with the transition std), 'k1' (logp_theta - logp_ref of the sampled x'), 'k3' "
                          "(exp(logp_ref - logp_theta) - 1 - (logp_ref - logp_theta), per element) or 'velocity' "
                          "(mean squared difference of the policy's and the reference's velocities). All use the "
                          "log-probs' mean over the non-batch dims."},
    )
    on_policy_tolerance: float = field(
        default=1e-3,
        metadata={"help": "On the first pass over a fresh batch the ratio must be exactly 1; warn when |ratio - 1| "
                          "exceeds this (dtype or batch-composition mismatch, dropout, non-determinism)."},
    )
    policy_loss: str = field(
        default="clip",
        metadata={"help": "The policy objective: 'clip' (PPO's clipped ratio, clip range epsilon) or 'dppo' "
                          "(Flow-DPPO: no ratio clipping; a sample's -A ratio term is dropped only when the per-element "
                          "mean Gaussian KL between its transition under the trained weights and the frozen anchor, "
                          "the pre-update weights' transition means replayed once per batch without gradient, is at "
                          "least dppo_tau and its ratio still moves in its advantage's direction). dppo only differs "
                          "from plain policy gradient from the second pass on: use num_iterations >= 2 (UniRL: 2)."},
    )
    dppo_tau: float = field(
        default=1e-5,
        metadata={"help": "Flow-DPPO's trust region: the per-element mean of (mu_theta - mu_old)^2 / (2 std^2) above "
                          "which a sample moving further in its advantage's direction is dropped (UniRL, verl-omni: "
                          "1e-5). > 0."},
    )

    # ---- BranchGRPO tree rollouts ---------------------------------------------------------------------
    branch_steps: list[int] = field(
        default_factory=list,
        metadata={"help": "BranchGRPO: sampling steps at which every node of a prompt's tree splits into "
                          "branch_factor children (e.g. [0, 3, 6, 9] of 20), so the G = branch_factor ** "
                          "len(branch_steps) samples of a group share their prefixes (G must equal num_generations). "
                          "Node rewards are the mean of their leaves, advantages are normalised per depth within "
                          "each tree, and every edge is trained with its child's advantage. Empty (default): no tree, "
                          "independent rollouts."},
    )
    branch_factor: int = field(
        default=2, metadata={"help": "BranchGRPO: children per node at each split step (BranchGRPO: 2). >= 2."},
    )
    branch_noise_scale: float = field(
        default=4.0,
        metadata={"help": "BranchGRPO: the noise of a split child is drawn with this multiple of the step's std (the "
                          "official script: 4.0), so that siblings differ more. > 0."},
    )
    branch_split_log_prob: str = field(
        default="exact",
        metadata={"help": "BranchGRPO: the log-prob of a split edge, for the old and the trained policy alike: "
                          "'exact' (the density it was drawn from, std x branch_noise_scale) or 'unscaled' (the "
                          "official code's quirk: the unscaled std, so the ratio is that of a density the sample was "
                          "not drawn from; only for comparing with published runs)."},
    )
    branch_pruning: str = field(
        default="none",
        metadata={"help": "BranchGRPO: which edges are trained: 'none' (all), 'width' (after the last split keep only "
                          "part of the edges by advantage, see branch_width_mode and branch_width_ratio) or 'depth' "
                          "(leave out the edges into the depths branch_prune_depths)."},
    )
    branch_width_mode: str = field(
        default="per_branch",
        metadata={"help": "BranchGRPO width pruning: 'per_branch' (the best branch_width_ratio of each last-split "
                          "branch's edges, at least one; official mode 1) or 'best_worst' (the best and the worst "
                          "half of branch_width_ratio of all edges after the last split; official mode 2)."},
    )
    branch_width_ratio: float = field(
        default=0.5, metadata={"help": "BranchGRPO width pruning: share of the edges after the last split that is "
                                       "kept (official: 0.5). In (0, 1]."},
    )
    branch_prune_depths: list[int] | None = field(
        default=None,
        metadata={"help": "BranchGRPO depth pruning: depths (levels 1 .. num_inference_steps; the node after "
                          "sampling step s is at depth s + 1) whose incoming edges are not trained, e.g. [15, 16, 17, "
                          "18]. Sampling and rewards are unchanged."},
    )
    branch_prune_slide_interval: int = field(
        default=0,
        metadata={"help": "BranchGRPO depth pruning: move the pruned depths up by one every this many optimizer "
                          "steps, down to the last split's depth (the official sliding window; its script: 30). "
                          "0: fixed depths."},
    )

    # ---- TempFlow-GRPO branching --------------------------------------------------------------------------
    tempflow_children: int = field(
        default=0,
        metadata={"help": "TempFlow-GRPO: > 0 samples each group as one ODE trajectory that branches, at each of "
                          "tempflow_branch_steps, into this many SDE children, each continued by ODE to its image "
                          "(official: 6). A child's only stochastic step is trained, with the advantage among its "
                          "siblings (the children of the same state) and the loss weighted by tempflow_noise_weight x "
                          "the step's std. num_generations must be tempflow_children x len(tempflow_branch_steps). 0 "
                          "(default): no branching."},
    )
    tempflow_branch_steps: list[int] | None = field(
        default=None,
        metadata={"help": "TempFlow-GRPO: the sampling steps the trajectory branches at (0 .. num_inference_steps - "
                          "2). Unset: every step but the last, as the official script."},
    )
    tempflow_noise_weight: float = field(
        default=2.25,
        metadata={"help": "TempFlow-GRPO: c in the loss weight c x std_j of the clipped objective at branch step j "
                          "(std_j the step's transition std; official: 2.25). > 0."},
    )


    _trainer_name = "FlowGRPOTrainer"

    def _check_algorithm(self) -> None:
        check_choice("sde_type", self.sde_type, SDE_TYPES)
        check_choice("sde_window_strategy", self.sde_window_strategy, SDE_WINDOW_STRATEGIES)
        check_choice("ode_solver", self.ode_solver, ODE_SOLVERS)
        check_choice("ratio_normalization", self.ratio_normalization, RATIO_NORMALIZATIONS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for name in ("sde_window_roll_back", "same_noise_per_group"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false.")
        for name in ("sde_window_shift_interval", "sde_window_stride"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        ratio = self.ode_compression_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"ode_compression_ratio={ratio!r} must be in (0, 1] (1.0 keeps every step; "
                             "MixGRPO-Flash uses 0.4).")
        if ratio < 1 and self.ode_solver != "dpmpp_2m":
            raise ValueError(f"ode_compression_ratio={ratio} replaces the steps after the window by fewer "
                             f"DPM-Solver++ steps; it needs ode_solver='dpmpp_2m' (got ode_solver="
                             f"{self.ode_solver!r}). Set ode_solver: dpmpp_2m, or ode_compression_ratio: 1.0.")
        fraction = self.timestep_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"timestep_fraction={fraction!r} must be in (0, 1] (1.0 trains every recorded step; "
                             "DanceGRPO uses 0.6).")
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level} must be >= 0.")
        if self.epsilon <= 0:
            raise ValueError(f"epsilon={self.epsilon} must be > 0.")
        self._check_window()
        self._check_policy_loss()
        self._check_branching()
        self._check_tempflow()

    def _check_policy_loss(self) -> None:
        check_choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        if not self.dppo_tau > 0:
            raise ValueError(f"dppo_tau={self.dppo_tau} must be > 0 (Flow-DPPO: 1e-5).")
        if self.policy_loss == "dppo" and self.num_iterations < 2:
            warnings.warn(
                f"policy_loss='dppo' with num_iterations={self.num_iterations}: on the single pass over a fresh batch "
                "the trained weights equal the anchor's, so the divergence is 0, nothing is dropped and the loss is "
                "plain policy gradient (-A ratio); the trust region only acts from the second pass. Set "
                "num_iterations: 2 (UniRL's setting) to use it.", stacklevel=3,
            )

    def _check_branching(self) -> None:
        check_choice("branch_split_log_prob", self.branch_split_log_prob, BRANCH_SPLIT_LOG_PROBS)
        check_choice("branch_pruning", self.branch_pruning, BRANCH_PRUNINGS)
        check_choice("branch_width_mode", self.branch_width_mode, BRANCH_WIDTH_MODES)
        if self.branch_steps is None:
            self.branch_steps = []
        if isinstance(self.branch_steps, int) and not isinstance(self.branch_steps, bool):
            self.branch_steps = [self.branch_steps]
        self.branch_steps = list(check_branch_steps(self.branch_steps, self.num_inference_steps, self.branch_factor))
        if not self.branch_noise_scale > 0:
            raise ValueError(f"branch_noise_scale={self.branch_noise_scale} must be > 0 (BranchGRPO: 4.0; 1.0 draws "
                             "split children with the step's own std).")
        ratio = self.branch_width_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"branch_width_ratio={ratio!r} must be in (0, 1] (BranchGRPO: 0.5).")
        interval = self.branch_prune_slide_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"branch_prune_slide_interval={interval!r} must be an integer >= 0 (0: fixed depths).")
        if self.branch_prune_depths is not None:
            depths = [self.branch_prune_depths] if isinstance(self.branch_prune_depths, int) \
                else list(self.branch_prune_depths)
            steps = self.num_inference_steps  # unset: the model's own, checked once the trainer has resolved it
            bad = [d for d in depths if isinstance(d, bool) or not isinstance(d, int)
                   or d < 1 or (steps is not None and d > steps)]
            if bad:
                raise ValueError(f"branch_prune_depths {bad} must be depths in 1 .. num_inference_steps = "
                                 f"{self.num_inference_steps} (the node after sampling step s is at depth s + 1).")
            self.branch_prune_depths = sorted(set(depths))
        if not self.branch_steps:
            if self.branch_pruning != "none":
                raise ValueError(f"branch_pruning={self.branch_pruning!r} prunes a BranchGRPO tree, but branch_steps "
                                 "is empty (no tree); set branch_steps (e.g. [0, 3, 6, 9]) or branch_pruning: none.")
            return
        leaves = self.branch_factor ** len(self.branch_steps)
        if leaves != self.num_generations:
            raise ValueError(f"branch_steps={self.branch_steps} with branch_factor={self.branch_factor} gives trees of "
                             f"{self.branch_factor}^{len(self.branch_steps)} = {leaves} leaves, but num_generations="
                             f"{self.num_generations}: each tree is one group. Set num_generations: {leaves}, or "
                             "change the split steps.")
        if self.sde_window_size != 0:
            raise ValueError(f"branch_steps needs SDE sampling on every step (the tree's edges are all trained), but "
                             f"sde_window_size={self.sde_window_size}; set sde_window_size: 0.")
        if self.noise_level <= 0:
            raise ValueError(f"branch_steps needs stochastic steps, but noise_level={self.noise_level}; set "
                             "noise_level > 0 (DanceGRPO's eta: 0.3 with sde_type: dance).")
        steps = self.num_inference_steps  # unset: the model's own, checked once the trainer has resolved it
        if steps is not None and max(self.branch_steps) >= steps - 1:
            raise ValueError(f"branch_steps={self.branch_steps} splits at the last sampling step {steps - 1}, which is "
                             "the deterministic step to the clean sample (the x0-prediction the official code "
                             f"decodes): its children would be identical. Split at steps 0 .. {steps - 2}.")
        refused = {
            "timestep_fraction": (self.timestep_fraction < 1, "every edge of a tree is trained (leave out edges "
                                  "with branch_pruning instead); set timestep_fraction: 1.0"),
            "filter_zero_std_groups": (self.filter_zero_std_groups, "dynamic sampling would replace single leaves "
                                       "of a tree; set filter_zero_std_groups: false"),
            "regularizer": (self.regularizer == "gardo", "GARDO gates leaves, not a tree's edges; unset regularizer"),
            "base_model_tail_steps": (self.base_model_tail_steps > 0, "every step but the last is a trained edge; "
                                      "set base_model_tail_steps: 0"),
            "reward_aggregation": (self.reward_aggregation != "weighted_sum", "node rewards are means of the leaves' "
                                   "weighted reward, normalised per depth; set reward_aggregation: weighted_sum"),
            "ode_compression_ratio": (self.ode_compression_ratio < 1, "the tree follows the schedule's own steps; "
                                      "set ode_compression_ratio: 1.0"),
        }
        for name, (bad, fix) in refused.items():
            if bad:
                raise ValueError(f"branch_steps (BranchGRPO trees) cannot be combined with {name}="
                                 f"{getattr(self, name)!r}: {fix}.")
        if self.branch_pruning == "depth":
            if not self.branch_prune_depths:
                raise ValueError("branch_pruning='depth' needs branch_prune_depths, the depths whose edges are left "
                                 "out, e.g. [15, 16, 17, 18] for 20 steps.")

    def _check_tempflow(self) -> None:
        children = self.tempflow_children
        if isinstance(children, bool) or not isinstance(children, int) or children < 0:
            raise ValueError(f"tempflow_children={children!r} must be an integer >= 0 (0: no TempFlow-GRPO branching; "
                             "official: 6).")
        if not self.tempflow_noise_weight > 0:
            raise ValueError(f"tempflow_noise_weight={self.tempflow_noise_weight} must be > 0 (official: 2.25).")
        if children == 0:
            if self.tempflow_branch_steps is not None:
                raise ValueError(f"tempflow_branch_steps={self.tempflow_branch_steps} needs tempflow_children > 0 (the "
                                 "children each branch step gets; official: 6).")
            return
        if children < 2:
            raise ValueError(f"tempflow_children={children}: a branch step's advantages compare its children, so it "
                             "needs at least 2 (official: 6).")
        steps = self.num_inference_steps  # unset: the model's own, checked once the trainer has resolved it
        if self.tempflow_branch_steps is None:
            if steps is None:
                return
            from .tempflow import default_branch_steps

            self.tempflow_branch_steps = default_branch_steps(int(steps))
        values = [self.tempflow_branch_steps] if isinstance(self.tempflow_branch_steps, int) \
            else list(self.tempflow_branch_steps)
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0
               or (steps is not None and v > steps - 2)]
        if not values or bad or len(set(values)) != len(values):
            raise ValueError(f"tempflow_branch_steps={self.tempflow_branch_steps} must be distinct sampling steps in "
                             f"0 .. num_inference_steps - 2 = {'T - 2' if steps is None else steps - 2} (the last step "
                             "is the deterministic step to the clean sample).")
        self.tempflow_branch_steps = sorted(values)
        rows = children * len(values)
        if self.num_generations != rows:
            raise ValueError(f"tempflow_children={children} at {len(values)} branch steps gives {rows} images a "
                             f"group, but num_generations={self.num_generations}: each group is one trajectory's "
                             f"children. Set num_generations: {rows}.")
        refused = {
            "branch_steps": (bool(self.branch_steps), "BranchGRPO's trees and TempFlow's branches are two rollouts; "
                             "use one"),
            "sde_window_size": (self.sde_window_size != 0, "the branch steps are the stochastic steps; set "
                                "sde_window_size: 0"),
            "noise_level": (self.noise_level <= 0, "the children need stochastic steps; set noise_level > 0 "
                            "(official: 0.7)"),
            "ode_solver": (self.ode_solver != "euler", "the trunk and the children's continuations are Euler steps, "
                           "as the official code's"),
            "same_noise_per_group": (self.same_noise_per_group, "a group's children share their trunk by "
                                     "construction"),
            "timestep_fraction": (self.timestep_fraction < 1, "each child has one stochastic step, always trained"),
            "filter_zero_std_groups": (self.filter_zero_std_groups, "dynamic sampling would refill whole prompt "
                                       "groups, not sibling sets"),
            "base_model_tail_steps": (self.base_model_tail_steps > 0, "the children are continued by the policy"),
            "policy_loss": (self.policy_loss != "clip", "TempFlow-GRPO weights the clipped objective"),
        }
        for name, (wrong, fix) in refused.items():
            if wrong:
                raise ValueError(f"tempflow_children (TempFlow-GRPO) cannot be combined with {name}="
                                 f"{getattr(self, name)!r}: {fix}.")

    @property
    def uses_tempflow(self) -> bool:
        """Whether rollouts are TempFlow-GRPO branches (tempflow_children > 0)."""
        return bool(self.tempflow_children)

    @property
    def uses_branching(self) -> bool:
        """Whether rollouts are BranchGRPO trees (branch_steps is not empty)."""
        return bool(self.branch_steps)

    def _check_window(self) -> None:
        steps = self.num_inference_steps
        k = self.sde_window_size
        if steps is None and k > 0:  # the model's own step count: checked once the trainer has resolved it
            return
        if k < 0:
            raise ValueError(f"sde_window_size={k} must be >= 0 (0 = SDE on every step but the last).")
        if k == 0:
            if self.sde_window_strategy != "random":
                raise ValueError(f"sde_window_strategy={self.sde_window_strategy!r} moves an SDE window, but "
                                 "sde_window_size=0 makes every step but the last stochastic; set sde_window_size "
                                 "(e.g. 4 for MixGRPO) or use sde_window_strategy='random'.")
            return
        if k > steps - 1:
            raise ValueError(f"sde_window_size={k} must be at most num_inference_steps - 1 = {steps - 1} (the last "
                             "step is nearly deterministic and never trained); lower the window or raise the step "
                             "count.")
        if self.sde_window_range is None:
            if self.sde_window_strategy == "random":
                self.sde_window_range = [0, max(1, min(steps // 2, steps - k))]
            else:
                self.sde_window_range = [0, steps - k]
        if len(self.sde_window_range) != 2:
            raise ValueError(f"sde_window_range={self.sde_window_range} must be two integers [lo, hi).")
        lo, hi = (int(v) for v in self.sde_window_range)
        if lo < 0 or hi <= lo or hi + k > steps:
            raise ValueError(
                f"sde_window_range={[lo, hi]} with sde_window_size={k} does not fit num_inference_steps={steps}: "
                f"the latest window [{hi - 1}, {hi - 1 + k}) must end before the last step {steps - 1}. Use "
                f"0 <= lo < hi <= {steps - k}."
            )
        self.sde_window_range = [lo, hi]


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def recorded_steps(args: FlowGRPOConfig) -> int:
    """SDE steps a rollout records per sample: the window, or every step but the last (a BranchGRPO tree records
    them all; a TempFlow-GRPO child its one branch step)."""
    if args.tempflow_children:
        return 1
    steps = int(args.num_inference_steps or 0)
    window = int(args.sde_window_size or 0)
    return window if window > 0 else max(1, steps - 1)


def last_recorded_step(args: FlowGRPOConfig) -> int | None:
    """The last sampling step a rollout may record (None when the steps after the window are compressed, or the step
    count is not known yet)."""
    steps = args.num_inference_steps
    if steps is None or args.ode_compression_ratio != 1.0:
        return None
    if args.tempflow_children and args.tempflow_branch_steps:
        return max(args.tempflow_branch_steps)
    size = args.sde_window_size
    return steps - 2 if size == 0 else args.sde_window_range[1] + size - 2


def describe_flow_grpo(args: FlowGRPOConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """Flow-GRPO's facts: SDE rollouts recording their window's transitions, one trained forward and backward per
    recorded step (a tree: per edge), the clipped ratio against the rollout's own log-probs."""
    recorded = recorded_steps(args)
    trained = recorded if args.timestep_fraction >= 1 else max(1, int(recorded * args.timestep_fraction))
    means = args.ratio_normalization == "grpo_guard" or args.policy_loss == "dppo" or bool(args.branch_steps)
    rollout_passes = trained_per_sample = 0.0
    if args.branch_steps and args.num_inference_steps:
        from .branch_grpo import tree_passes

        rollout_passes, trained_per_sample = tree_passes(int(args.num_inference_steps), args.branch_steps,
                                                         args.branch_factor)
    if args.tempflow_children and args.num_inference_steps and args.tempflow_branch_steps:
        from .tempflow import tempflow_cost

        rollout_passes, parts = tempflow_cost(int(args.num_inference_steps), args.tempflow_branch_steps,
                                              args.tempflow_children, int(args.per_device_train_batch_size))
        trained = max(1, round(parts))  # backward passes per micro-batch: one per branch step it holds
        trained_per_sample = 1.0  # each child trains its one transition
    refusal = None
    if args.tempflow_children:
        refusal = (f"tempflow_children={args.tempflow_children} samples each group as a trajectory's branches "
                   "(TempFlow-GRPO), which the rollout workers do not sample yet.")
    if args.policy_loss == "dppo":
        staleness = ("a sample k steps old is replayed by the trainer's weights at the start of its step (Flow-DPPO's "
                     "anchor): the trust region and the ratio are taken around the weights being updated, as with "
                     "fresh samples; the stale sampler only chose which states are visited.")
        replay = ("stale generations: every recorded transition's mean and log-prob under the trainer's weights at the "
                  "start of the step (the anchor), one forward without gradient per recorded step")
    else:
        staleness = ("a sample k steps old is trained with its behaviour log-probs: the clipped ratio is taken "
                     "against the weights that sampled it (PPO with stale samples; truncated_importance_cap "
                     "reweights it by the replayed proximal policy instead).")
        replay = ""
    if args.truncated_importance_cap is not None:
        replay = ("stale generations: every recorded transition's log-prob under the trainer's weights at the start of "
                  "the step (the proximal policy), for the truncated importance weights")
    if args.branch_steps:
        staleness += " A tree's edges carry the log-probs they were drawn with (split-aware)."
    fields = ("latents", "next_latents", "log_probs", "timesteps", "sigmas", "sigmas_next", "window") + (
        ("means",) if means else ()) + (("tempflow_step",) if args.tempflow_children else ())
    return AlgorithmFacts(
        copies=(),
        reads_reference=args.beta > 0,
        record=RolloutRecord("transitions", fields=fields, steps=recorded, means=means,
                             last_step=last_recorded_step(args), loss_reads_log_probs=True),
        workers=WorkerNeeds(
            refusal=refusal, sampled_by="policy", synced=("reference",) if args.base_model_tail_steps > 0 else (),
            staleness=staleness, importance_weights=True, switch_step=None, whole_groups=bool(args.branch_steps),
            trainer_replay=replay),
        probe=TransitionProbe("recorded_transition", noise_level=float(args.noise_level or 0.7), sde_type="sde"),
        step=PlannedStep("recorded_transition", trained_timesteps=trained, trained_per_sample=trained_per_sample,
                         rollout_passes=rollout_passes, frozen_forwards=("reference",) if args.beta > 0 else (),
                         loss="ratio", stored_per_step=3 if means else 2,
                         noise_level=float(args.noise_level or 0.0), sde_type=args.sde_type,
                         unsharded_reference=args.beta > 0),
    )


SPEC = AlgorithmSpec(
    name="flow_grpo", title="Flow-GRPO",
    config="flowgrpo.trainer.algorithms.flow_grpo_config:FlowGRPOConfig",
    trainer="flowgrpo.trainer.algorithms.flow_grpo_trainer:FlowGRPOTrainer",
    summary="SDE rollouts, the clipped likelihood ratio of each recorded step (Fast, CPS, MixGRPO, GRPO-Guard, "
            "DanceGRPO, Flow-DPPO, BranchGRPO, TempFlow-GRPO variants)",
    describe=describe_flow_grpo,
    eval_guidance_rollouts_refusal=("the ratio is the likelihood of each recorded SDE transition under the guided "
                                    "velocity that sampled it, so the trained velocity must use the rollouts' guidance "
                                    "(on a first pass the ratio is exactly 1)"),
    sequence_parallel=True,  # tested: tests/distributed/test_sequence_parallel.py
)
