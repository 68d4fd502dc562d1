"""Trainer callbacks the tests share."""

from transformers import TrainerCallback


class StopAfter(TrainerCallback):
    """Stops training after ``step`` optimizer steps, like a job killed right after a checkpoint."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control
