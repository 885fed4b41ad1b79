"""The fork server (relax_hpc.launch.forkserver): real forks of a real server process, a child
program of the tests' own (tests/unit/fork_child.py) standing in for a role."""

import os
import signal
import sys
import time

import psutil
import pytest

from relax_hpc.launch.forkserver import KILLED, ForkServer, ForkServerError, StartAbandoned, forkable
from relax_hpc.launch.gpus import NO_GPU

CHILD = "tests.unit.fork_child"


@pytest.fixture
def server(tmp_path):
    forks = ForkServer([CHILD], {**os.environ, "FORK_TEST_MARKER": "server"})
    yield forks
    forks.close()


def start(forks, tmp_path, *args, name="child", env=None, abandon=None):
    log = tmp_path / f"{name}.log"
    env = env or {**os.environ, "FORK_TEST_MARKER": name}
    child = forks.start([sys.executable, "-m", CHILD, *args], env, log, abandon)
    return child, log


def test_forkable_takes_plain_and_cpu_only_role_commands_and_nothing_else():
    py = sys.executable
    engine = [py, "-m", "relax_hpc.engines.torch_engine", "--run-dir", "/r"]
    assert forkable(engine) == (engine, {})
    assert forkable([py, "-m", "relax_hpc.launch.gpus", NO_GPU, "--", *engine]) == (
        engine,
        {"CUDA_VISIBLE_DEVICES": ""},
    )
    assert forkable([py, "-m", "relax_hpc.launch.gpus", "0-1", "--", *engine]) is None  # a GPU slice starts fresh
    assert forkable(["apptainer", "exec", "img.sif", "python", *engine[1:]]) is None
    assert forkable(["/other/python", *engine[1:]]) is None
    assert forkable([py, "-m", "json.tool"]) is None
    assert forkable([py, "-m", CHILD], [CHILD]) == ([py, "-m", CHILD], {})


def test_a_forked_child_runs_its_module_as_main_with_its_own_env_log_title_and_exit_status(server, tmp_path):
    child, log = start(server, tmp_path, "--sleep", "1.5", "--exit", "3")
    time.sleep(0.5)
    title = " ".join(psutil.Process(child.pid).cmdline())
    assert f"-m {CHILD} --sleep 1.5 --exit 3" in title
    assert child.poll() is None
    assert child.wait(timeout=20) == 3
    out = log.read_text()
    assert "argv=['--sleep', '1.5', '--exit', '3'] marker=child" in out  # the request's env, not the server's
    assert f"name=__main__ sid={child.pid} pid={child.pid}" in out  # run as __main__, in a session of its own
    second, second_log = start(server, tmp_path, name="second")
    assert second.wait(timeout=20) == 0 and "marker=second" in second_log.read_text()


def test_a_child_that_raises_exits_1_with_its_traceback_in_its_log(server, tmp_path):
    child, log = start(server, tmp_path, "--raise")
    assert child.wait(timeout=20) == 1
    assert "RuntimeError: the child failed on purpose" in log.read_text()


def test_a_killed_child_reports_the_signal_and_wait_times_out_while_it_runs(server, tmp_path):
    child, _ = start(server, tmp_path, "--sleep", "60")
    with pytest.raises(Exception, match="timed out"):
        child.wait(timeout=0.3)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=20) == -signal.SIGKILL


def test_children_outlive_a_dead_server_and_the_next_start_brings_up_a_new_one(server, tmp_path):
    child, _ = start(server, tmp_path, "--sleep", "60")
    first_server = server._proc.pid
    os.kill(first_server, signal.SIGKILL)
    server._proc.wait()
    assert child.poll() is None  # its status died with the server, not the child
    assert psutil.Process(child.pid).is_running()
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child.returncode == KILLED
    again, log = start(server, tmp_path, "--exit", "4", name="again")
    assert server._proc.pid != first_server
    assert again.wait(timeout=60) == 4 and "marker=again" in log.read_text()
    assert (tmp_path / "forkserver.log").exists()  # beside the log of the role that started it


def test_a_command_outside_the_servers_modules_is_refused(server, tmp_path):
    with pytest.raises(ForkServerError, match="not a role"):
        server.start([sys.executable, "-m", "json.tool"], dict(os.environ), tmp_path / "x.log")


def test_a_start_abandoned_during_the_imports_forks_nothing_and_the_next_start_forks(tmp_path):
    imported = tmp_path / "imported"  # the server's imports are done
    forks = ForkServer([CHILD], {**os.environ, "FORK_TEST_IMPORT_S": "5", "FORK_TEST_IMPORTED": str(imported)})
    try:
        asked = time.monotonic()
        with pytest.raises(StartAbandoned):
            start(forks, tmp_path, name="abandoned", abandon=lambda: time.monotonic() - asked > 0.5)
        assert not imported.exists()  # abandoned during the imports, not after them
        child, log = start(forks, tmp_path, name="next")  # waits for the same server's imports
        assert child.wait(timeout=20) == 0 and "marker=next" in log.read_text()
        assert not (tmp_path / "abandoned.log").exists()  # no late fork of the abandoned start
    finally:
        forks.close()
