"""`status` on a run whose launcher wrote no end: running while any of its heartbeats beats, ended
once they stopped (the writer gone from this host, or silent for STALE_S elsewhere), saying when
and how it was last seen."""

from __future__ import annotations

import json
import socket
import subprocess
import time

from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.paths import RunPaths
from relax_hpc.status import STALE_S, _role_exit, collect


def beat(paths: RunPaths, role: str, pid: int, host: str, age_s: float) -> None:
    paths.health(role).parent.mkdir(parents=True, exist_ok=True)
    paths.health(role).write_text(json.dumps({"time": time.time() - age_s, "pid": pid, "host": host}))


def test_a_start_without_its_end_runs_while_a_heartbeat_beats_and_has_ended_once_they_stopped(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text(to_yaml(load_config(None)))
    JsonlWriter(paths.events_metrics).log({"event": "start", "step": 0, "slurm_job_id": None})
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = socket.gethostname()
    beat(paths, "trainer", gone.pid, here, age_s=1)  # a process of this host that has exited
    beat(paths, "launcher", 1, "elsewhere", age_s=STALE_S - 10)  # another host's, still fresh
    assert collect(paths.root)["state"] == "running"
    beat(paths, "launcher", 1, "elsewhere", age_s=STALE_S + 60)
    state = collect(paths.root)["state"]
    assert state.startswith("ended without its end record: last seen "), state
    assert "the trainer's heartbeat (pid" in state and "nothing said why (killed)" in state, state
    beat(paths, "driver", 1, here, age_s=STALE_S + 60)  # pid 1 lives: this host's process beats on, however old
    assert collect(paths.root)["state"] == "running"


def test_a_restart_line_names_the_exits_cause_and_its_nodes_fault():
    exit_ = {"event": "role_exit", "role": "engine-0", "action": "restart", "nodes": ["n2"], "last_line": "Traceback"}
    lines = [
        _role_exit({**exit_, "exit": 76}),  # an event of a launcher that did not record the cause
        _role_exit({**exit_, "exit": 137, "node_fault": {"node": "n2", "cause": "NODE_FAIL"}}),
        _role_exit({**exit_, "exit": -9, "hung": "no heartbeat for 130 s (hung)", "nodes": []}),
    ]
    assert lines == [
        "engine-0: fenced (exit 76: superseded by a newer start of the run) on n2 (restart)",
        "engine-0: exit 137 (SIGKILL) on n2; node n2: NODE_FAIL (restart)",
        "engine-0: hung: no heartbeat for 130 s (hung) (restart)",
    ]
