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


def test_summary_ends_with_the_peak_memory_on_a_gpu():
    t = _timer([30.0, 12.0] + [0.1] * 20)
    assert t.summary(int(7.11 * 2**30)) == ("median step 100.0 ms (steps 11-22); first step 30.0 s, second step "
                                            "12.0 s; peak GPU memory 7.11 GiB")


def test_restart_excludes_the_time_between_steps():
    t = StepTimer()
    t.step_done()
    t._last -= 100.0  # a long sample/save between two steps ...
    t.restart()  # ... is not counted
    t.step_done()
    assert t.durations[1] < 1.0


def test_a_wait_for_the_gpu_between_steps_goes_to_the_last_step():
    # one-batch epochs with a step that is queued in 30 ms: the epoch end waits 0.3 s for the GPU, then the
    # epoch-end work (2 s) is left out; the median is the 330 ms a step really takes
    t = StepTimer()
    t.waited()  # nothing finished yet: nothing to add to, and nothing carried over
    assert t.durations == []
    for _ in range(12):
        t._last -= 0.03
        t.step_done()
        t._last -= 0.3
        t.waited()
        t._last -= 2.0
        t.restart()
    assert [round(d, 2) for d in t.durations] == [0.33] * 12
    assert t.summary().startswith("median step 330.0 ms")


def _shaped(steps, setup_steps_per_shape=2):
    """steps: (seconds, shape) per step, timed as if they had taken that long."""
    t = StepTimer(setup_steps_per_shape=setup_steps_per_shape)
    for seconds, shape in steps:
        t._last -= seconds
        t.step_done([shape])
    t.durations = [round(d, 3) for d in t.durations]
    return t


def test_bucket_shapes_setup_steps_are_counted_and_left_out_of_the_median():
    a, b, c = (1, 4, 128, 128), (1, 4, 112, 144), (1, 4, 144, 112)
    # a: compile then record; b, c: warm-up then record (shape-generic graphs); c's recording at step 12
    steps = [(30.0, a), (12.0, a), (0.5, b), (0.2, a), (10.0, b)] + [(0.2, a)] * 5 + [(0.5, c), (10.0, c)]
    steps += [(0.1, b), (0.1, c), (0.1, a), (0.3, b)]
    t = _shaped(steps)
    assert t.setup == [True, True, True, False, True] + [False] * 5 + [True, True] + [False] * 4
    assert t.summary() == ("median step 100.0 ms (steps 13-16); first step 30.0 s, second step 12.0 s; "
                           "3 input shapes: 6 setup steps (compile, graph recording) 63.0 s in all")
    # without CUDA graphs only each shape's first step is setup
    t = _shaped(steps, setup_steps_per_shape=1)
    assert sum(t.setup) == 3 and t.summary().endswith("3 input shapes: 3 setup steps (compile) 31.0 s in all")


def test_one_shape_or_no_shapes_keeps_the_plain_summary():
    steps = [(30.0, "s"), (12.0, "s")] + [(0.1, "s")] * 20
    assert _shaped(steps).summary() == "median step 100.0 ms (steps 11-22); first step 30.0 s, second step 12.0 s"
    t = StepTimer()
    t.step_done()
    assert t.setup == [False] and t.seen == {}
    # a new shape's steps at the very end leave no step after them: the median falls back to after the warm-up
    assert _shaped([(0.2, "a")] * 12 + [(5.0, "b"), (5.0, "b")]).summary().startswith("median step 200.0 ms (steps 8-14)")
