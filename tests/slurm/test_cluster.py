"""The one-host Slurm cluster behaves as the project's Slurm tests need it to.

Jobs run and sacct reports them; 2-node jobs and heterogeneous jobs (components on different
nodes) run; a job in ``debug`` is preempted by a job in ``high``: its batch shell gets the
``--signal=B:...`` signal first and the job is requeued (SLURM_RESTART_COUNT=1 on its second run),
whether it waits for the end of GraceTime or requeues itself with ``scontrol requeue``; while it is
being preempted, and only then, the launcher's ``preempting`` sees it (its PreemptTime), and a
requeue by hand is no preemption.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from relax_hpc.launch.slurm import preempting

pytestmark = pytest.mark.slurm

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


def _sbatch(*args: str) -> str:
    return _run("sbatch", "--parsable", *args).strip().split(";")[0]


def _wait(what: str, predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _states(job: str) -> list[str]:
    """Every accounting record of JOB (allocation only, oldest first): one per run."""
    out = _run("sacct", "-n", "-X", "-P", "-D", "-j", job, "-o", "state")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _finished(job: str, runs: int = 1) -> list[str] | None:
    states = _states(job)
    if len(states) >= runs and states[-1] in TERMINAL:
        return states
    return None


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _keys(lines: list[str]) -> list[str]:
    """The events a victim script logged, in order (Slurm's and bash's own lines left out)."""
    return [x.split()[0] for x in lines if x.split() and x.split()[0] in {"run", "ready", "USR2", "TERM", "requeue"}]


def _stamp(lines: list[str], key: str) -> float:
    """The t= of the first line that starts with KEY."""
    line = next(x for x in lines if x.startswith(key))
    return float(line.rsplit("t=", 1)[1])


def test_cluster_is_up(slurm_cluster):
    out = _run("sinfo", "-h", "-N", "-o", "%N %P %t %c %m")
    rows = {tuple(line.split()) for line in out.splitlines()}
    for node in slurm_cluster.nodes:
        assert (node, "debug*", "idle", "4", "4000") in rows
        assert (node, "high", "idle", "4", "4000") in rows


def test_sbatch_job_completes_in_sacct(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job = _sbatch("-o", str(out), "--wrap", "echo hello from $SLURMD_NODENAME restart=${SLURM_RESTART_COUNT:-0}")
    assert _wait("job to finish", lambda: _finished(job), 20) == ["COMPLETED"]
    assert _run("sacct", "-n", "-X", "-P", "-j", job, "-o", "exitcode").split() == ["0:0"]
    # sacct's partition (and other fields) fill in seconds after the state: ask slurmctld
    assert "Partition=debug" in _run("scontrol", "show", "job", job).split()
    hello, _from, node, restart = out.read_text().split()
    assert (hello, node in slurm_cluster.nodes, restart) == ("hello", True, "restart=0")


def test_two_node_job_with_gpus(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job = _sbatch(
        "-N2", "--ntasks-per-node=1", "--gpus-per-node=1", "-o", str(out),
        "--wrap", "srun bash -c 'echo $SLURMD_NODENAME gpu=$CUDA_VISIBLE_DEVICES'",
    )  # fmt: skip
    assert _wait("job to finish", lambda: _finished(job), 20) == ["COMPLETED"]
    lines = sorted(_lines(out))
    assert [x.split()[1] for x in lines] == ["gpu=0", "gpu=0"], lines
    assert len({x.split()[0] for x in lines}) == 2, lines


def test_heterogeneous_job_runs_both_components_on_different_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "het.out"
    script = tmp_path / "het.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --ntasks=1 --cpus-per-task=2\n"
        "#SBATCH hetjob\n"
        "#SBATCH --ntasks=1 --cpus-per-task=1\n"
        "srun --het-group=0 bash -c 'echo comp0 $SLURMD_NODENAME' : "
        "--het-group=1 bash -c 'echo comp1 $SLURMD_NODENAME'\n"
        "echo groups $SLURM_JOB_NODELIST_HET_GROUP_0 $SLURM_JOB_NODELIST_HET_GROUP_1\n"
    )
    job = _sbatch("-o", str(out), str(script))
    _wait("hetjob to finish", lambda: _finished(f"{job}+1") and _finished(f"{job}+0"), 30)
    assert _states(f"{job}+0") == ["COMPLETED"] and _states(f"{job}+1") == ["COMPLETED"]
    lines = _lines(out)
    comp = dict(line.split()[:2] for line in lines if line.startswith("comp"))
    assert set(comp) == {"comp0", "comp1"}
    assert comp["comp0"] != comp["comp1"], lines
    assert f"groups {comp['comp0']} {comp['comp1']}" in lines


VICTIM = """#!/bin/bash
#SBATCH --partition=debug --nodelist={node} --cpus-per-task=4 --time=10
#SBATCH --requeue --open-mode=append --signal=B:USR2@1 --output={out}
echo "run restart=${{SLURM_RESTART_COUNT:-0}} t=$(date +%s.%N)"
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then exit 0; fi
trap 'echo "TERM t=$(date +%s.%N)"; exit 0' TERM
{usr2_trap}
echo "ready t=$(date +%s.%N)"
while :; do sleep 5 & wait $!; done
"""
# waits for GraceTime to end: Slurm then sends SIGTERM (SIGKILL after KillWait) and requeues
WAIT_TRAP = """trap 'echo "USR2 t=$(date +%s.%N)"' USR2"""
# requeues itself (as submitit does) and exits: the preemptor starts at once
REQUEUE_TRAP = (
    """trap 'echo "USR2 t=$(date +%s.%N)"; scontrol requeue $SLURM_JOB_ID; echo "requeue rc=$?"; exit 0' USR2"""
)


def test_preempted_job_gets_batch_signal_then_is_requeued(slurm_cluster, tmp_path):
    victims = {}
    for name, node, trap in (("wait", "n3", WAIT_TRAP), ("self", "n4", REQUEUE_TRAP)):
        out = tmp_path / f"{name}.out"
        script = tmp_path / f"{name}.sh"
        script.write_text(VICTIM.format(node=node, out=out, usr2_trap=trap))
        victims[name] = (_sbatch(str(script)), node, out)
    for name, (_, _, out) in victims.items():
        _wait(f"{name} victim to run", lambda out=out: any(x.startswith("ready") for x in _lines(out)), 20)

    waiting = victims["wait"][0]
    assert not preempting(waiting)
    preemptors = {}
    t_preempt = time.time()
    for name, (_, node, _) in victims.items():
        preemptors[name] = _sbatch("-p", "high", "-w", node, "-c", "4", "-o", "/dev/null", "--wrap", "true")
    _wait("the notice of preemption", lambda: "USR2" in _keys(_lines(victims["wait"][2])), 10)
    assert preempting(waiting)  # in its GraceTime (15 s), before the SIGTERM

    for name, (job, _, out) in victims.items():
        _wait(f"{name} victim's second run", lambda job=job: _finished(job, runs=2), 60)
        assert _finished(preemptors[name]) == ["COMPLETED"]
        lines = _lines(out)
        keys = _keys(lines)
        t_usr2 = _stamp(lines, "USR2")
        assert 0 <= t_usr2 - t_preempt < 5, lines  # the signal comes at preemption, not near the limit
        assert _stamp(lines, "run restart=1") > t_usr2
        if name == "wait":
            # USR2 at preemption; SIGTERM only when GraceTime (15 s) is over; then requeued
            assert keys == ["run", "ready", "USR2", "TERM", "run"], lines
            assert _stamp(lines, "TERM") - t_usr2 > 10, lines
            assert _states(job) == ["PREEMPTED", "COMPLETED"]
        else:
            # `scontrol requeue` from the trap works during the grace time and ends the run at once
            assert keys[:4] == ["run", "ready", "USR2", "requeue"] and keys[-1] == "run", lines
            assert "requeue rc=0" in lines
            assert "TERM" not in keys[:3]
            assert _states(job) == ["REQUEUED", "COMPLETED"]
            assert _stamp(lines, "run restart=1") - t_usr2 < 15, lines


def test_scontrol_requeue_sends_term_not_the_user_signal(slurm_cluster, tmp_path):
    out = tmp_path / "rq.out"
    script = tmp_path / "rq.sh"
    script.write_text(VICTIM.format(node="n2", out=out, usr2_trap=WAIT_TRAP))
    job = _sbatch(str(script))
    _wait("job to run", lambda: any(x.startswith("ready") for x in _lines(out)), 20)
    t_requeue = time.time()
    _run("scontrol", "requeue", job)
    assert not preempting(job)
    _wait("second run", lambda: _finished(job, runs=2), 30)
    lines = _lines(out)
    keys = _keys(lines)
    assert keys == ["run", "ready", "TERM", "run"], lines
    assert _stamp(lines, "TERM") - t_requeue < 3
    assert "restart=1" in lines[-1]
    assert _states(job) == ["REQUEUED", "COMPLETED"]
    assert _stamp(lines, "run restart=1") - t_requeue < 15, lines
