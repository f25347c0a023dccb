"""The step events of library.run.events, each on its own: when it is due (after a step, after an epoch) and what
it does, on a small stand-in for the run state (no model, no training)."""
from __future__ import annotations

import types

import pytest

from library.run import events, loop


class Trainer:
    def __init__(self):
        self.calls = []

    def save_checkpoint(self, state, epoch, step, *, by_step, prune=True):
        self.calls.append(("save", epoch, step, state.ext, by_step, prune))

    def sample_images(self, state, *, epoch):
        self.calls.append(("sample", epoch, state.global_step))

    def validation_loss(self, state):
        self.calls.append(("validate", state.global_step))
        return 0.5


class Accelerator:
    is_main_process = True

    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((step, values))


class Validator:
    last_loss = None

    def __init__(self, every_step=None, every_epoch=None):
        self.every_step, self.every_epoch, self.reports = every_step, every_epoch, []

    def due_after_step(self, step):
        return bool(self.every_step) and step % self.every_step == 0

    def due_after_epoch(self, epoch):
        return bool(self.every_epoch) and epoch % self.every_epoch == 0

    def report(self, accelerator, loss, avr, *, global_step, epoch, at_epoch_end):
        self.reports.append((loss, global_step, epoch, at_epoch_end))


def make_state(**args):
    defaults = dict(save_every_n_steps=None, save_every_n_epochs=None, sample_prompts=None, sample_every_n_steps=None,
                    sample_every_n_epochs=None, gradient_accumulation_steps=1)
    state = types.SimpleNamespace(
        args=types.SimpleNamespace(**{**defaults, **args}), trainer=Trainer(), accelerator=Accelerator(),
        trainable=types.SimpleNamespace(models=[]), metadata={}, ext=".safetensors", components=None, prediction_type="epsilon",
        global_step=4, epoch=0, num_epochs=3, max_train_steps=10, num_batches=2, steps_per_epoch=2,
        at_epoch_end=False, asked=set(), stopping=False, validator=None, losses=[], last_loss=float("nan"),
        avr_loss=float("nan"), log_with=None, stop=types.SimpleNamespace(flag=False), pauses=[])
    state.done_epoch = state.epoch + 1
    state.pause = lambda: state.pauses.append("pause")
    state.resume = lambda: state.pauses.append("resume")
    return state


def test_save_every_n_steps_and_save_now():
    state = make_state(save_every_n_steps=2)
    save = events.Save()
    assert save.due(state)  # step 4
    save.run(state)
    assert state.trainer.calls == [("save", 1, 4, ".safetensors", True, True)]
    assert state.pauses == ["pause", "resume"]  # pending losses read first, timer restarted after
    state.global_step, state.trainer.calls = 5, []
    assert not save.due(state)
    state.asked = {"save"}
    assert save.due(state)
    save.run(state)
    assert state.trainer.calls == [("save", 1, 5, ".safetensors", True, False)]  # Save now: never pruned


def test_save_at_epoch_end_not_after_the_last_epoch():
    state = make_state(save_every_n_epochs=1)
    state.at_epoch_end = True
    save = events.Save()
    assert save.due(state)
    save.run(state)
    assert state.trainer.calls == [("save", 1, 4, ".safetensors", False, True)]
    state.done_epoch = 3  # the last epoch: the final save follows anyway
    assert not save.due(state)
    state.done_epoch, state.global_step = 2, 10  # the last step was reached
    assert not save.due(state)


def test_sample_by_steps_epochs_and_sample_now(tmp_path):
    prompts = str(tmp_path / "p.txt")
    state = make_state(sample_prompts=prompts, sample_every_n_steps=4, sample_every_n_epochs=2)
    sample = events.Sample()
    assert sample.due(state)
    sample.run(state)
    state.global_step, state.asked = 5, {"sample"}
    assert sample.due(state)
    sample.run(state)
    state.asked = set()
    assert not sample.due(state)
    state.at_epoch_end, state.done_epoch = True, 2
    assert sample.due(state)
    sample.run(state)
    assert state.trainer.calls == [("sample", None, 4), ("sample", None, 5), ("sample", 2, 5)]


def test_stop_is_due_on_request_except_at_the_last_step():
    state = make_state()
    stop = events.Stop()
    assert not stop.due(state)
    state.asked = {"stop"}
    assert stop.due(state)
    stop.run(state)
    assert state.stopping and state.stop.flag
    state.global_step = state.max_train_steps
    assert not stop.due(state)


def test_take_requests_every_step_only():
    taken = []
    state = make_state()
    state.requests = types.SimpleNamespace(take=lambda acc, stop_flag: taken.append(stop_flag) or {"save"})
    take = events.TakeRequests()
    assert take.due(state)
    take.run(state)
    assert state.asked == {"save"} and taken == [False]
    state.at_epoch_end = True
    assert not take.due(state)


def test_validate_after_steps_and_epochs():
    state = make_state()
    state.validator = Validator(every_step=2, every_epoch=1)
    validate = events.Validate()
    assert validate.due(state)
    validate.run(state)
    assert state.validator.reports == [(0.5, 4, 1, False)] and state.pauses == ["pause", "resume"]
    state.global_step = 5
    assert not validate.due(state)
    state.at_epoch_end = True
    assert validate.due(state)
    validate.run(state)
    assert state.validator.reports[-1] == (0.5, 5, 1, True)
    assert not events.Validate().due(make_state())  # no validator


def test_progress_reports_each_step_once_its_loss_is_read(capsys):
    class Bar:
        def __init__(self):
            self.n, self.postfix = 0, None

        def update(self, n):
            self.n += n

        def set_postfix(self, **kw):
            self.postfix = kw

        def write(self, text, file):
            print(text, file=file)

    class Late:
        def step_done(self, record):
            return [(record, [0.25, 0.75])]

        def flush(self):
            return []

    from library.train_util import ProgressLine

    state = make_state()
    state.lr_scheduler = types.SimpleNamespace(get_last_lr=lambda: [1e-4])
    state.norm_logs, state.norm_postfix = {}, {}
    state.timer = types.SimpleNamespace(waited=lambda: None)
    bar = Bar()
    progress = events.Progress(bar, ProgressLine(10, 3), Late())
    progress.run(state)
    assert bar.n == 1 and state.losses == [0.25, 0.75] and state.last_loss == 0.75
    assert state.avr_loss == pytest.approx(0.5)  # the window is one epoch's micro-steps
    assert "steps: 4/10 loss=0.7500" in capsys.readouterr().out
    progress.flush(state)


def test_epoch_loss_logged_to_trackers():
    state = make_state()
    state.log_with, state.losses, state.at_epoch_end = "tensorboard", [1.0, 2.0, 4.0], True
    epoch_loss = events.EpochLoss()
    assert epoch_loss.due(state)
    epoch_loss.run(state)
    assert state.accelerator.logged == [(4, {"loss/epoch": 3.0})]


def test_run_due_runs_the_due_events_in_order_and_forgets_the_requests():
    state = make_state(save_every_n_steps=4)
    state.requests = types.SimpleNamespace(take=lambda acc, stop_flag: {"stop"})
    loop.run_due([events.TakeRequests(), events.Save(), events.Stop()], state, at_epoch_end=False)
    assert state.trainer.calls[0][0] == "save" and state.stopping and state.asked == set()
