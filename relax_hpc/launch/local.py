"""The `local` executor: every role is a process of this machine, forked by the fork server where
it can be (launch.forkserver).

SIGINT, SIGTERM or SIGUSR1 ask the trainer to checkpoint and stop (exit 75; the same command
resumes); a second SIGINT kills everything at once.
"""

from __future__ import annotations

import signal

from relax_hpc.config.schema import JobConfig
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.forkserver import ForkServer, forkable
from relax_hpc.launch.gpus import place_local, visible_gpu_count
from relax_hpc.launch.supervisor import EXIT_STOPPED, Supervisor, child_env
from relax_hpc.paths import RunPaths


def run_local(cfg: JobConfig, paths: RunPaths) -> int:
    devices = place_local(cfg, visible_gpu_count())
    # The fork server (launch.fork_roles), for the modules of the roles it can start, if any.
    modules = [command[0][2] for argv in local_commands(cfg, paths, devices).values() if (command := forkable(argv))]
    forks = ForkServer(modules, child_env(cfg)) if cfg.launch.fork_roles and modules else None
    # torchrun --standalone picks a free port and a new rendezvous id at every start.
    supervisor = Supervisor(
        cfg, paths, lambda: local_commands(cfg, paths, devices), devices=devices.summary, forks=forks
    )
    interrupts = 0

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal interrupts
        interrupts += signum == signal.SIGINT
        if interrupts >= 2:
            supervisor.request_kill()
        supervisor.request_stop(f"{signal.Signals(signum).name} (Ctrl-C again to kill at once)")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    try:
        code = supervisor.run()
    finally:
        if forks is not None:
            forks.close()
    if code == EXIT_STOPPED:
        print("run the same command to resume")
    return code
