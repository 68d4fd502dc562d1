"""The training run's terminal output (flowgrpo.trainer.console): one bar with the key figures, a table per
evaluation, the full dictionaries only when asked, and everything still in the run's log history."""

from __future__ import annotations

import numpy as np
from datasets import Dataset
from peft import LoraConfig

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.trainer.console import TrainingConsole, evaluation_table, train_figures

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "three yellow stars"]


def brightness(prompts, images, **columns):
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


def darkness(prompts, images, **columns):
    return [1.0 - float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


def test_figures_and_evaluation_table():
    logs = {"reward": 0.41234, "reward_std": 0.12, "rewards/ocr/mean": 0.4, "rewards/jpeg/mean": -0.125,
            "loss": 1.2e-05, "timing/rollout": 3.0, "ratio_mean": 1.0}
    assert train_figures(logs, ["ocr", "jpeg"]) == "reward 0.412±0.120 | ocr 0.400 | jpeg -0.125 | loss 1.2e-05"
    assert train_figures({"train_runtime": 3.0}, ["ocr"]) == ""  # nothing to show: no line
    # rollouts on Ray workers: the staleness of the trained samples ends the line
    assert train_figures({"reward": 0.5, "rollout/staleness_max": 1.0}, ["ocr"]) == "reward 0.500±n/a | stale 1"
    table = evaluation_table({"eval_reward": 0.5, "eval_reward_std": 0.1, "eval_rewards/ocr/mean": 0.5,
                              "eval_rewards/ocr/std": 0.1, "eval_rewards/ocr/count": 16.0,
                              "eval_rewards/ocr/change": 0.03, "eval_rewards/ocr/change_se": 0.01}, ["ocr"], 20)
    lines = table.splitlines()
    assert lines[0] == "evaluation at step 20: reward 0.500 ± 0.100"
    assert lines[1].split() == ["reward", "mean", "std", "images", "change", "since", "first"]
    assert lines[2].split() == ["ocr", "0.500", "0.100", "16", "+0.030", "±", "0.010"]


def _trainer(path, tmp_path, **kwargs):
    settings = dict(
        output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4, num_generations=2,
        resolution=64, num_inference_steps=2, eval_num_inference_steps=2, guidance_scale=1.0, max_steps=2,
        beta=0.0, max_sequence_length=16, logging_steps=1, save_strategy="no", seed=0, log_images_steps=0,
        dtype="float32", eval_on_start=True, eval_strategy="no", per_device_eval_batch_size=4)
    args = FlowGRPOConfig(**{**settings, **kwargs})
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    return FlowGRPOTrainer(model=str(path), reward_funcs=[brightness, darkness], args=args, train_dataset=dataset,
                           eval_dataset=dataset.select(range(2)),
                           peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"]))


def test_training_shows_one_bar_and_evaluation_tables_not_dictionaries(tiny_sd3_path, tmp_path, capsys,
                                                                       monkeypatch):
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    import flowgrpo.trainer.console as console

    monkeypatch.setattr(console, "terminal_is_interactive", lambda: True)  # as on a terminal
    trainer = _trainer(tiny_sd3_path, tmp_path, disable_tqdm=False)
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert TrainingConsole in kinds and ProgressCallback not in kinds and PrinterCallback not in kinds
    trainer.train()
    err, out = capsys.readouterr()[::-1]
    terminal = out + err
    assert "training: 100%" in terminal and "s/step" in terminal
    assert "reward " in terminal and "brightness " in terminal and "darkness " in terminal
    assert "evaluation at step 0" in terminal  # eval_on_start
    assert "'timing/rollout'" not in terminal and "{'" not in terminal  # no raw dictionary
    assert "rollout" not in [line.split(":")[0] for line in terminal.replace("\r", "\n").splitlines()]  # no 2nd bar
    logged = [h for h in trainer.state.log_history if "timing/rollout" in h]  # the loggers still get everything
    assert len(logged) == 2 and "rewards/brightness/mean" in logged[0]


def test_log_lines_without_a_bar_and_full_dictionaries_on_request(tiny_sd3_path, tmp_path, capsys):
    trainer = _trainer(tiny_sd3_path, tmp_path, disable_tqdm=True, max_steps=1)
    trainer.train()
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 1 and steps[0].startswith("step 1/1 | reward ") and steps[0].endswith(" s/step")
    assert not any(line.startswith("{") for line in lines)

    trainer = _trainer(tiny_sd3_path, tmp_path, disable_tqdm=True, max_steps=1, print_full_logs=True)
    trainer.train()
    out = capsys.readouterr().out
    assert "'timing/rollout'" in out and "'eval_reward'" in out


def test_a_log_file_gets_one_line_per_logging_step_and_no_bar_refreshes(tiny_sd3_path, tmp_path, capsys):
    """Without a terminal (a cluster job's log), the console prints lines even when the bar is not disabled: nothing
    carriage-return-refreshed, one line per logging step (the rollout label never rewrites anything)."""
    trainer = _trainer(tiny_sd3_path, tmp_path, disable_tqdm=False, max_steps=2)
    capsys.readouterr()  # what loading printed (diffusers' own bars)
    trainer.train()
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "training:" not in out + err
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == ["step 1/2", "step 2/2"]
