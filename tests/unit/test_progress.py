"""The launcher's progress line: its interval when written to a file, and rates measured from
the current start only (a restart's gap is no step time)."""

import io
import itertools
import time

from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.metrics.progress import Progress
from relax_hpc.paths import RunPaths


def test_lines_to_a_file_come_at_the_configured_interval(tmp_path):
    """Whatever the load: no two lines within the interval, and a line at every call once the
    interval has passed since the last. Each call is timed from before it to after it (the line's
    own time lies between), so both hold under any scheduling delay."""
    paths = RunPaths(tmp_path)
    out = io.StringIO()
    progress = Progress(paths, total_steps=10, out=out, log_every_s=0.2)
    calls = []  # (before, after, wrote a line)
    started = time.monotonic()
    while time.monotonic() - started < 1.0:
        before, written = time.monotonic(), len(out.getvalue())
        progress.show(engines_up=2, engines_total=2)
        calls.append((before, time.monotonic(), len(out.getvalue()) > written))
        time.sleep(0.01)
    lines = [(b, a) for b, a, wrote in calls if wrote]
    assert calls[0][2] and len(lines) == len(out.getvalue().splitlines()) >= 2  # the first at once
    assert all(later_after - before >= 0.2 for (before, _), (_, later_after) in itertools.pairwise(lines))
    last_after = calls[0][1]
    for before, after, wrote in calls[1:]:
        assert wrote or before - last_after < 0.2, "the interval passed without a line"
        last_after = after if wrote else last_after
    assert out.getvalue().startswith("step 0/10 | reward -")


def test_rates_count_only_the_steps_of_this_start(tmp_path):
    paths = RunPaths(tmp_path)
    train = JsonlWriter(paths.train_metrics)
    # The previous start's steps, long before this one: their gap must not dilute the rate.
    with paths.train_metrics.open("a") as f:
        for step in (1, 2):
            f.write(f'{{"time": {time.time() - 3600 + step}, "step": {step}, "reward": 0.1, "samples": 100, '
                    f'"staleness_mean": 0.0}}\n')  # fmt: skip
    progress = Progress(paths, total_steps=10, out=io.StringIO(), log_every_s=1.0)
    now = time.time()
    for step, dt in ((3, 0.0), (4, 1.0), (5, 2.0)):
        with paths.train_metrics.open("a") as f:
            f.write(f'{{"time": {now + dt}, "step": {step}, "reward": 0.1, "samples": 100, "staleness_mean": 0.0}}\n')
    line = progress.line(engines_up=1, engines_total=1)
    assert "step 5/10" in line and "100 samples/s" in line, line
    train.close()
