"""Bad nodes (launch.badnodes): only failures that belong to a node count against it (Slurm's
NODE_FAIL, an unreachable slurmd, a device error), classified from the lines roles' logs end with;
never a fenced exit, a hang, a crash or an out-of-memory; and the exclusion leaves a job enough nodes."""

from __future__ import annotations

import pytest

from relax_hpc.fence import EXIT_FENCED
from relax_hpc.launch.badnodes import bad_nodes, failures, newly_bad, node_fault, usable_exclusion

# As srun printed them on the test cluster (a slurmd stopped with SIGSTOP: under a running step, with
# SlurmdTimeout=5, Node failure after 23 s; at a launch, tests/slurm/test_bad_nodes.py) and as CUDA,
# NCCL and nvidia-smi print a failed device.
NODES_FAULTS = [
    ("srun: error: Node failure on n2", "NODE_FAIL"),
    ("srun: error: Task launch for StepId=1.3 failed on node n2: Socket timed out on send/recv operation",
     "slurmd unreachable: Socket timed out on send/recv operation"),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "device error"),
    ("torch.AcceleratorError: CUDA error: uncorrectable NVLink error detected during the execution", "device error"),
    ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", "device error"),
    ("Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the system to recover this GPU",
     "device error"),
    ("engine.cc:123 NCCL WARN Cuda failure 'system not yet initialized'", "device error"),
]  # fmt: skip
THE_RUNS = [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "RuntimeError: CUDA error: device-side assert triggered",
    "RuntimeError: CUDA error: unspecified launch failure",
    "srun: error: Task launch for StepId=1.4 failed on node n2: Invalid job credential",
    "fenced: trainer serial 3 is superseded; exiting without writing",
]


@pytest.mark.parametrize(("line", "cause"), NODES_FAULTS)
def test_node_failures_and_device_errors_are_the_nodes(line, cause):
    fault = node_fault(1, f"a line before\n{line}\n", ["n2"])
    assert fault is not None and fault["node"] == "n2" and fault["cause"].startswith(cause), fault


@pytest.mark.parametrize("line", THE_RUNS)
def test_the_programs_own_errors_are_not_the_nodes(line):
    assert node_fault(1, line, ["n2"]) is None


def test_no_fault_in_a_fenced_or_clean_exit_and_no_device_error_named_on_several_nodes():
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    assert node_fault(EXIT_FENCED, ecc, ["n2"]) is None and node_fault(0, ecc, ["n2"]) is None
    assert node_fault(1, ecc, ["n1", "n2"]) is None  # which of the trainer's nodes: not known
    assert node_fault(1, "srun: error: Node failure on n2", ["n1", "n2"]) == {"node": "n2", "cause": "NODE_FAIL"}
    assert node_fault(1, "srun: error: Node failure on n9", ["n1"]) is None  # not this role's node


def exit_on(nodes: list[str], fault: str | None = "NODE_FAIL", code: int = 1, hung: str | None = None) -> dict:
    node_fault = {"node": nodes[0], "cause": fault} if fault else None
    return {"event": "role_exit", "role": "engine-0", "exit": code, "hung": hung, "nodes": nodes,
            "node_fault": node_fault}  # fmt: skip


def test_a_node_is_bad_after_two_faults_of_its_own_and_clearing_starts_the_count_again():
    events = [exit_on(["n1"]), exit_on(["n2"]), exit_on(["n1"], "device error: uncorrectable ECC error encountered")]
    assert failures(events) == {"n1": 2, "n2": 1}
    assert bad_nodes(events, 2) == ["n1"] and bad_nodes(events, 1) == ["n1", "n2"] and bad_nodes(events, 0) == []
    assert newly_bad(events, ["n1"], 2) == ["n1"] and newly_bad([*events, exit_on(["n1"])], ["n1"], 2) == []
    cleared = [*events, {"event": "bad_nodes_cleared"}, exit_on(["n1"])]
    assert failures(cleared) == {"n1": 1} and bad_nodes(cleared, 2) == []


def test_a_node_that_failed_under_an_allocation_counts():
    events = [exit_on(["n1"]), {"event": "node_failed", "node": "n1", "cause": "NODE_FAIL (Slurm: down*)"}]
    assert failures(events) == {"n1": 2} and bad_nodes(events, 2) == ["n1"]


def test_fenced_hung_and_failed_roles_without_a_node_fault_mark_no_node():
    """The issue's two healthy nodes: roles fenced by a second launcher (exit 76), each failure on its node."""
    fenced = [exit_on(["n1"], None, code=EXIT_FENCED), exit_on(["n2"], None, code=EXIT_FENCED)]
    events = [*fenced, exit_on(["n1"], None, code=-9, hung="no heartbeat for 60 s"), exit_on(["n1"], None)] * 2
    assert failures(events) == {} and bad_nodes(events, 1) == []


def test_the_exclusion_leaves_the_job_enough_nodes():
    assert usable_exclusion(["n3", "n1"], ["n1", "n2", "n3", "n4"], needed=2) == (["n3", "n1"], [])
    assert usable_exclusion(["n3", "n1"], ["n1", "n2", "n3", "n4"], needed=3) == (["n3"], ["n1"])
    assert usable_exclusion(["n1"], ["n1"], needed=1) == ([], ["n1"])  # the only node stays in
    assert usable_exclusion(["x9"], ["n1", "n2"], needed=1) == ([], [])  # not in the partition: nothing to do
