"""The step-time summary every training run ends with (library.step_timer)."""
from library import step_timer
from library.step_timer import StepTimer


def _timer(durations, start_step=0):
    t = StepTimer(start_step)
    t.durations = list(durations)
    return t


def test_median_leaves_out_the_compile_and_recording_steps():
    # 30 s compile, 12 s graph recording, then 8 steps of 0.2 s and 12 of 0.1 s
    t = _timer([30.0, 12.0] + [0.2] * 8 + [0.1] * 12)
    assert step_timer.WARMUP_STEPS == 10
    assert t.summary() == "median step 100.0 ms (steps 11-22); first step 30.0 s, second step 12.0 s"


def test_resumed_run_counts_from_its_start_step_and_short_runs_keep_half():
    t = _timer([5.0, 0.3, 0.25, 0.35], start_step=100)
    assert t.summary() == "median step 300.0 ms (steps 103-104); first step 5.0 s, second step 0.3 s"
    assert _timer([]).summary() is None
    assert _timer([2.0]).summary() == "median step 2000.0 ms (steps 1-1)"


def test_restart_excludes_the_time_between_steps():
    t = StepTimer()
    t.step_done()
    t._last -= 100.0  # a long sample/save between two steps ...
    t.restart()  # ... is not counted
    t.step_done()
    assert t.durations[1] < 1.0
