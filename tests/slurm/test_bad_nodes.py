"""Bad nodes on the real controller: what a role's srun says when its node's slurmd does not answer
(the node's fault), the exclude list a requeued (pending) job gets, the last usable nodes kept in,
what `status` says, and clearing. Held jobs stand in for requeued ones (both are pending, which is
when Slurm takes an ExcNodeList). The whole way through a launcher's own requeue is in
test_runs.py (the sbatch recipe)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from relax_hpc.launch.badnodes import exclude_if_requeued, failed_nodes, node_fault
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.paths import RunPaths
from tests.slurm.jobs import CONFIG, REPO, slurm, wait_until


def held_job(nodes: int) -> str:
    return slurm("sbatch", "--parsable", "--hold", f"-N{nodes}", "-o", "/dev/null", "--wrap", "true").strip()


def excluded(job: str) -> str:
    fields = dict(f.split("=", 1) for f in slurm("scontrol", "-o", "show", "job", job).split() if "=" in f)
    return fields["ExcNodeList"]


def failed_twice_on(run_dir: Path, node: str) -> RunPaths:
    """A run whose roles failed twice on `node` by its fault (the supervisor's role_exit records)."""
    paths = RunPaths(run_dir)
    run_dir.mkdir()
    paths.config.write_text(CONFIG.read_text())
    events = JsonlWriter(paths.events_metrics)
    for _ in range(2):
        events.log({"event": "role_exit", "role": "engine-0", "exit": 1, "restarts": 0, "action": "restart",
                    "nodes": [node], "last_line": "", "hung": None,
                    "node_fault": {"node": node, "cause": "NODE_FAIL"}})  # fmt: skip
    return paths


def status(run_dir: Path, *args: str) -> str:
    argv = [sys.executable, "-m", "relax_hpc.status", str(run_dir), *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True, timeout=120).stdout


def test_a_bad_node_is_excluded_from_the_pending_job_until_cleared(slurm_cluster, tmp_path):
    paths = failed_twice_on(tmp_path / "run", "n2")
    job = held_job(1)
    try:
        paths.slurm_job_id.parent.mkdir(parents=True, exist_ok=True)
        paths.slurm_job_id.write_text(f"{job}\n")
        said = exclude_if_requeued(paths, job, 2, JsonlWriter(paths.events_metrics))
        assert said == [f"bad node(s) n2 excluded from job {job}'s next start"] and excluded(job) == "n2"
        assert "bad nodes:   n2 (failed roles per node: n2 2); excluded from the job: n2" in status(paths.root)
        cleared = status(paths.root, "--clear-bad-nodes")
        assert cleared == f"bad nodes cleared; pending job {job} may start on any node again\n"
        assert excluded(job) == "(null)" and "bad nodes:" not in status(paths.root)
    finally:
        slurm("scancel", job)


def test_a_running_job_is_not_excluded_from_and_the_record_says_so(slurm_cluster, tmp_path):
    paths = failed_twice_on(tmp_path / "run", "n2")
    job = slurm("sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "sleep 60").strip()
    try:
        wait_until(lambda: slurm("squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING", 30, "the job's start")
        said = exclude_if_requeued(paths, job, 2, JsonlWriter(paths.events_metrics))
        assert said[-1].startswith(f"job {job}: nothing excluded (") and excluded(job) == "(null)"
        assert "no longer pending" in said[-1]  # Slurm's own answer
        assert "excluded from the job: none" in status(paths.root)
    finally:
        slurm("scancel", job)


def test_the_last_usable_nodes_are_never_excluded(slurm_cluster, tmp_path):
    paths = failed_twice_on(tmp_path / "run", "n3")
    job = held_job(len(slurm_cluster.nodes))  # needs every node of the partition
    try:
        said = exclude_if_requeued(paths, job, 2, JsonlWriter(paths.events_metrics))
        assert said == [f"bad node(s) n3 NOT excluded: job {job} needs 4 of the debug partition's nodes"]
        assert excluded(job) == "(null)"
        assert [e["nodes"] for e in read_jsonl(paths.events_metrics) if e["event"] == "bad_node_kept"] == [["n3"]]
    finally:
        slurm("scancel", job)


@pytest.mark.parametrize("threshold", [0, 3])
def test_below_the_threshold_nothing_is_excluded(slurm_cluster, tmp_path, threshold):
    paths = failed_twice_on(tmp_path / "run", "n2")
    job = held_job(1)
    try:
        assert exclude_if_requeued(paths, job, threshold, JsonlWriter(paths.events_metrics)) == []
        assert excluded(job) == "(null)"
    finally:
        slurm("scancel", job)


def test_an_elastic_engine_job_is_submitted_without_the_bad_nodes(slurm_cluster, tmp_path):
    paths = failed_twice_on(tmp_path / "run", "n2")
    tree = yaml.safe_load(paths.config.read_text())
    tree.setdefault("launch", {})["executor"] = "slurm"
    paths.config.write_text(yaml.safe_dump(tree))
    argv = [sys.executable, "-m", "relax_hpc.scale", str(paths.root), "out", "--engines", "1", "--dry-run"]
    script = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "#SBATCH --exclude=n2\n" in script, script


def slurmd(node: str, conf: Path) -> psutil.Process:
    """The slurmd of `node` in this session's cluster (not another cluster's on this host)."""
    for process in psutil.process_iter(["cmdline"]):
        if process.info["cmdline"] != ["slurmd", "-D", "-N", node]:
            continue
        with contextlib.suppress(psutil.Error):
            if process.environ().get("SLURM_CONF") == str(conf):
                return process
    raise AssertionError(f"no slurmd of {node} for {conf}")


def test_a_launch_on_a_stopped_slurmd_is_the_nodes_fault(slurm_cluster, tmp_path):
    """A role's srun on a node whose slurmd is stopped: the launch times out, and the line srun
    leaves in the role's log makes the failure the node's. The client waits MessageTimeout (1 s
    in its own copy of slurm.conf, beside the cluster's) instead of the cluster's 10 s."""
    job = slurm("sbatch", "--parsable", "-N1", "-w", "n2", "-o", "/dev/null", "--wrap", "sleep 120").strip()
    conf = slurm_cluster.conf.with_name(f"slurm-{tmp_path.name}.conf")
    conf.write_text(slurm_cluster.conf.read_text() + "MessageTimeout=1\n")
    stopped = slurmd("n2", slurm_cluster.conf)
    try:
        wait_until(lambda: slurm("squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING", 30, "the job's start")
        stopped.suspend()
        out = subprocess.run(["srun", f"--jobid={job}", "--overlap", "-N1", "true"], capture_output=True, text=True,
                             check=False, timeout=120, env={**os.environ, "SLURM_CONF": str(conf)})  # fmt: skip
    finally:
        stopped.resume()
        conf.unlink()
        slurm("scancel", job)
    fault = node_fault(out.returncode, out.stderr, ["n2"])
    assert fault == {"node": "n2", "cause": "slurmd unreachable: Socket timed out on send/recv operation"}, out.stderr


def test_the_previous_allocations_node_that_slurm_holds_not_responding_failed(slurm_cluster):
    """A NODE_FAIL ends the launcher with its job: the next start asks Slurm about the previous
    allocation's nodes. Slurm's own marking takes SlurmdTimeout (with 5 s, 23 s on this cluster
    after a SIGSTOP of the slurmd); the same state set by hand stands in for it here."""
    before = [{"event": "allocation", "slurm_job_id": "77", "slurm_restart_count": 0, "nodes": ["n3", "n4"]}]
    slurm("scontrol", "update", "NodeName=n3", "State=DOWN", "Reason=Not responding")
    try:
        events = failed_nodes(before, "77", 1, ["n4"])
        assert failed_nodes(before, "77", 1, ["n3", "n4"])[0]["event"] == "allocation"  # n3 is in this allocation
    finally:
        slurm("scontrol", "update", "NodeName=n3", "State=RESUME")
    assert events == [
        {"event": "node_failed", "node": "n3", "cause": "NODE_FAIL (Slurm: down)", "slurm_job_id": "77"},
        {"event": "allocation", "slurm_job_id": "77", "slurm_restart_count": 1, "nodes": ["n4"]},
    ]
