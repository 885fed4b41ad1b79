"""Submit a run to Slurm through submitit (`launch.executor: slurm`).

One job: its batch shell runs relax_hpc.launch.slurm.SlurmRun, which starts the roles as job steps.
submitit has no heterogeneous jobs; HetSlurmExecutor adds them by appending `#SBATCH hetjob`
components to submitit's own submission file. Before submitting, `sbatch --test-only` lets Slurm
itself judge the request (partition, node counts, GPUs, limits), so a job that could never run is
refused with Slurm's reason instead of pending forever.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from relax_hpc.config.load import ConfigError
from relax_hpc.config.schema import JobConfig, SlurmConfig, SlurmRoleConfig
from relax_hpc.launch.guard import time_limit_problem
from relax_hpc.launch.slurm import SlurmRun
from relax_hpc.paths import RunPaths

NODE_LOCAL_FILESYSTEMS = {"tmpfs", "ramfs"}
# sbatch's words when it never reached the controller (as opposed to the controller saying no).
UNREACHABLE = ("configuration source", "configuration file", "Unable to contact slurm controller", "fetch_config")


class HetSlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor, plus heterogeneous components and one task per job.

    `components`: sbatch options of components 1, 2, ... (component 0 is the executor's own
    parameters). The batch shell is the only submitit task (use_srun=False): the run's job steps
    are started by the launcher inside it."""

    def __init__(self, folder: Path, components: list[dict[str, Any]], max_num_timeout: int) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout)
        self.components = components

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        if not self.components:
            return text
        lines = text.split("\n")
        last_option = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        extra = []
        for component in self.components:
            extra += ["#SBATCH hetjob"] + [_sbatch_line(k, v) for k, v in component.items()]
        return "\n".join(lines[: last_option + 1] + extra + lines[last_option + 1 :])

    def _num_tasks(self) -> int:
        return 1

    @property
    def _submitit_command_str(self) -> str:
        # exec: the Python process must be the batch shell itself, since `--signal=B:...` and
        # preemption notices reach only the batch shell; a bash parent would die of USR2 and
        # end the job.
        return "exec " + super()._submitit_command_str


def _sbatch_line(key: str, value: Any) -> str:
    key = key.replace("_", "-")
    return f"#SBATCH --{key}" if value is True or value == "" else f"#SBATCH --{key}={shlex.quote(str(value))}"


def _role_options(role: SlurmRoleConfig, sl: SlurmConfig, *, with_role_overrides: bool) -> dict[str, Any]:
    options = {
        "nodes": role.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": sl.cpus_per_node,
        "gpus_per_node": role.gpus_per_node or None,
        "mem": f"{int(sl.mem_gb * 1024)}MB" if sl.mem_gb else None,
        "partition": (role.partition if with_role_overrides else None) or sl.partition,
        "constraint": (role.constraint if with_role_overrides else None) or sl.constraint,
        "account": sl.account,
        "qos": sl.qos,
        "exclusive": True if sl.exclusive else None,
    }
    return {k: v for k, v in options.items() if v is not None}


def dependency(after: list[str]) -> dict[str, Any]:
    """sbatch options that start a job once every job of `after` has completed with exit 0, and
    cancel it when one of them cannot (failed, cancelled), instead of leaving it pending forever."""
    return {"dependency": "afterok:" + ":".join(after), "kill_on_invalid_dep": "yes"} if after else {}


def make_executor(cfg: JobConfig, paths: RunPaths, after: list[str] | None = None) -> HetSlurmExecutor:
    sl = cfg.launch.slurm
    if sl.heterogeneous:
        first = _role_options(sl.trainer, sl, with_role_overrides=True)
        components = [_role_options(sl.rollout, sl, with_role_overrides=True)]
    else:
        both = SlurmRoleConfig(
            nodes=sl.trainer.nodes + sl.rollout.nodes,
            gpus_per_node=max(
                sl.trainer.gpus_per_node + (0 if sl.rollout.nodes else sl.rollout.gpus_per_node),
                sl.rollout.gpus_per_node,
            ),
        )
        first, components = _role_options(both, sl, with_role_overrides=False), []
    executor = HetSlurmExecutor(paths.slurm, components, sl.max_timeouts)
    executor.update_parameters(
        job_name=sl.job_name,
        time=sl.time_min,
        use_srun=False,
        stderr_to_stdout=True,
        setup=list(sl.setup) or None,
        wckey=None,  # submitit's default wckey means nothing to the cluster's accounting
        signal_delay_s=sl.signal_lead_s,
        additional_parameters={
            # B: the batch shell (the launcher) gets the notice; submitit's default reaches job steps only.
            "signal": f"B:USR2@{sl.signal_lead_s}",
            "requeue": True,
            **dependency(after or []),
            **{k: (True if v == "" else v) for k, v in sl.extra_sbatch.items()},
        },
        **first,
    )
    return executor


def make_single_executor(sl: SlurmConfig, folder: Path, after: list[str]) -> HetSlurmExecutor:
    """A one-node, one-process job without GPUs and without requeue (a pipeline's export stage),
    charged and placed as `sl` says."""
    executor = HetSlurmExecutor(folder, [], max_num_timeout=0)
    options = _role_options(SlurmRoleConfig(nodes=1, gpus_per_node=0), sl, with_role_overrides=False)
    executor.update_parameters(
        job_name=sl.job_name, time=sl.time_min, use_srun=False, stderr_to_stdout=True, wckey=None,
        setup=list(sl.setup) or None, additional_parameters=dependency(after), **options,
    )  # fmt: skip
    return executor


def submission_text(executor: HetSlurmExecutor) -> str:
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


def preflight(cfg: JobConfig, paths: RunPaths) -> None:
    """What can be known before submitting, beyond the inputs submit checks for every executor:
    Slurm's tools on PATH, RUN_DIR's filesystem, a time limit that fits a step, and Slurm's own
    verdict on the request. Nothing is written before this passes."""
    for tool in ("sbatch", "srun", "scontrol", "sacct"):
        if shutil.which(tool) is None:
            raise ConfigError(
                f"launch.executor=slurm needs Slurm's `{tool}` on PATH (run on a login node, or use executor=local)"
            )
    sl = cfg.launch.slurm
    nodes = sl.trainer.nodes + sl.rollout.nodes
    fstype = filesystem_type(paths.root)
    if nodes > 1 and fstype in NODE_LOCAL_FILESYSTEMS:
        raise ConfigError(
            f"run.dir {paths.root} is on {fstype}, which each node has its own copy of; a {nodes}-node run "
            "needs RUN_DIR on a shared filesystem"
        )
    problem = time_limit_problem(cfg, paths)
    if problem:
        raise ConfigError(problem)
    ask_slurm(make_executor(cfg, paths))


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fstype
    return kind


def ask_slurm(executor: HetSlurmExecutor) -> str:
    """Ask Slurm whether it would accept and could ever start this job; its answer verbatim."""
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(submission_text(executor))
    try:
        out = subprocess.run(
            ["sbatch", "--test-only", f.name], check=False, capture_output=True, text=True, timeout=120
        )
    finally:
        Path(f.name).unlink()
    message = (out.stderr + out.stdout).strip()
    if out.returncode != 0 and any(m in message for m in UNREACHABLE):
        raise ConfigError(f"sbatch cannot reach Slurm (is this a login node? is SLURM_CONF right?): {message}")
    if out.returncode != 0:
        raise ConfigError(
            f"Slurm refuses this job: {message}\n"
            "change launch.slurm (partition, nodes, gpus_per_node, cpus_per_node, mem_gb, time_min) to what the "
            "partition offers (`sinfo -o '%P %D %c %m %G %l'`)"
        )
    return message


def submit(
    cfg: JobConfig, paths: RunPaths, function: Callable[[], object] | None = None, after: list[str] | None = None
) -> submitit.Job:
    """Submit the run (its batch shell runs `function`, by default SlurmRun's supervisor), to start
    once every job of `after` has completed."""
    return submit_with(make_executor(cfg, paths, after), function or SlurmRun(str(paths.root.resolve())))


def submit_with(executor: HetSlurmExecutor, function: Callable[[], object]) -> submitit.Job:
    try:
        return executor.submit(function)
    except subprocess.CalledProcessError as e:
        raise ConfigError(f"sbatch failed: {(e.stderr or b'').decode(errors='replace').strip()}") from None
