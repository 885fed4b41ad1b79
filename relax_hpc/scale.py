"""Grow and shrink a running training's rollout fleet (relax_hpc.launch.elastic).

    python -m relax_hpc.scale RUN_DIR out --engines N [--id ID] [--dry-run] [launch.slurm.KEY=VALUE ...]
    python -m relax_hpc.scale RUN_DIR out --url http://host:port [--id ID]
    python -m relax_hpc.scale RUN_DIR in (--engines N | --job JOBID | --url URL | --id ID) [--drain-timeout-s 60]
    python -m relax_hpc.scale RUN_DIR list [--json]

`out --engines N` submits a Slurm job of N engines (the run's engine kind and model; its
resources from the run's launch.slurm.rollout, changed by the KEY=VALUE overrides, e.g.
launch.slurm.rollout.partition=preempt launch.slurm.time_min=120). A run with the local executor
starts them as processes of this machine instead. `out --url` adds an SGLang server that already
runs elsewhere (started with the run's token as its --api-key, RUN_DIR/token). `--id` names the
operation; repeating an operation whose id exists and has not ended does nothing.

`in` drains engines: the driver sends them nothing new, requests in flight finish within
--drain-timeout-s or are aborted (the driver re-issues them elsewhere), then the engines leave
and their job ends. `--engines N` drains the N most recently added. The run's own engines
(engine-0, ...) cannot be drained.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from relax_hpc import cli
from relax_hpc.config.load import ConfigError, apply_override, read_frozen, validate
from relax_hpc.config.path_options import python_command
from relax_hpc.config.schema import JobConfig, SlurmConfig
from relax_hpc.launch.badnodes import bad_nodes, partition_nodes, usable_exclusion
from relax_hpc.launch.elastic import (
    ENDED,
    ElasticEngines,
    ScaleOp,
    in_flight,
    load_ops,
    new_id,
    op_state,
    register_external,
    save_op,
    serve,
)
from relax_hpc.launch.follow import queue_state
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import read_records, remove_record


class ScaleError(RuntimeError):
    """The request cannot be carried out (the message says why and what to do)."""


def elastic_config(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """The run's config with the elastic job's own launch.slurm settings."""
    tree = json.loads(cfg.model_dump_json())
    for override in overrides:
        if not override.startswith("launch.slurm."):
            raise ScaleError(f"{override}: an elastic job takes launch.slurm.* settings only")
        apply_override(tree, override)
    return validate(tree)


def exclude(paths: RunPaths, sl: SlurmConfig) -> dict[str, str]:
    """`--exclude` of the run's bad nodes (relax_hpc.launch.badnodes) for an elastic job."""
    bad = bad_nodes(read_jsonl(paths.events_metrics), sl.bad_node_failures)
    if not bad:
        return {}
    excluded, _ = usable_exclusion(bad, partition_nodes(sl.rollout.partition or sl.partition), needed=1)
    return {"exclude": ",".join(excluded)} if excluded else {}


def submit_elastic(cfg: JobConfig, paths: RunPaths, op: ScaleOp, dry_run: bool) -> str:
    from relax_hpc.config.schema import SlurmRoleConfig
    from relax_hpc.launch.submission import HetSlurmExecutor, _role_options, submission_text

    sl = cfg.launch.slurm
    per_engine = cfg.rollout.kind.gpus_per_engine(cfg.rollout) or 1
    gpus = op.engines * per_engine if sl.rollout.gpus_per_node else 0
    node = SlurmRoleConfig(
        nodes=1, gpus_per_node=gpus, partition=sl.rollout.partition, constraint=sl.rollout.constraint
    )
    executor = HetSlurmExecutor(paths.scale / "slurm" / op.id, [], sl.max_timeouts)
    executor.update_parameters(
        job_name=f"{sl.job_name}:{op.id}", time=sl.time_min, use_srun=False, stderr_to_stdout=True,
        setup=list(sl.setup) or None, wckey=None, signal_delay_s=sl.signal_lead_s,
        additional_parameters={"signal": f"B:USR2@{sl.signal_lead_s}", "requeue": True, **exclude(paths, sl)},
        **_role_options(node, cfg.launch.slurm, with_role_overrides=True),
    )  # fmt: skip
    if dry_run:
        return submission_text(executor)
    job = executor.submit(ElasticEngines(str(paths.root.resolve()), op.id))
    return str(job.job_id)


def start_local(paths: RunPaths, op: ScaleOp) -> str:
    """The local executor's elastic engines: a detached process of this machine."""
    log = paths.scale / "logs" / f"{op.id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax_hpc.scale", str(paths.root), "serve", op.id],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return f"local:{proc.pid}"


def scale_out(paths: RunPaths, args: argparse.Namespace) -> str:
    cfg = read_frozen(paths.config)
    if cfg.kind != "rl":
        raise ScaleError(f"{paths.root} is a kind={cfg.kind} run: it has no rollout engines to add")
    if not cfg.rollout.kind.elastic:  # an added engine's state is read from SGLang's /model_info
        raise ScaleError(f"{paths.root} runs {cfg.rollout.kind.label} engines: elastic scaling does not take them yet")
    ops = load_ops(paths)
    if args.id and any(o.id == args.id and _state(paths, o) not in ENDED for o in ops):
        return f"{args.id}: already requested ({_state(paths, next(o for o in ops if o.id == args.id))}); nothing to do"
    if args.url:
        if any(o.url == args.url and _state(paths, o) not in ENDED for o in ops):
            return f"{args.url} is already part of the run; nothing to do"
        op = ScaleOp(args.id or new_id("url"), "url", url=args.url)
        try:
            register_external(paths, op)
        except (EngineUnavailable, EngineRequestError) as e:
            raise ScaleError(f"{args.url} does not answer /model_info with the run's token ({e})") from None
        save_op(paths, op)
        return f"{op.id}: {args.url} registered; the next weight push brings it up to date"
    op = ScaleOp(args.id or new_id("slurm"), "slurm", engines=args.engines, overrides=list(args.overrides))
    if cfg.launch.executor == "local":
        if args.dry_run:
            return f"{op.id}: would start {op.engines} engine(s) on this machine"
        save_op(paths, op)
        op.job_id = start_local(paths, op)
    else:
        elastic = elastic_config(cfg, args.overrides)
        if args.dry_run:
            return submit_elastic(elastic, paths, op, dry_run=True)
        save_op(paths, op)
        op.job_id = submit_elastic(elastic, paths, op, dry_run=False)
    save_op(paths, op)
    follow = f"{python_command()} -m relax_hpc.scale {paths.root} list"
    return f"{op.id}: {op.engines} engine(s) in job {op.job_id}; `{follow}` follows them"


def _queue(op: ScaleOp) -> str | None:
    if op.kind != "slurm" or not op.job_id:
        return None
    if op.job_id.startswith("local:"):
        pid = int(op.job_id.split(":")[1])
        return "RUNNING" if Path(f"/proc/{pid}").exists() else None
    return queue_state(op.job_id)


def _state(paths: RunPaths, op: ScaleOp) -> str:
    return op_state(paths, op, _queue(op))


def scale_in(paths: RunPaths, args: argparse.Namespace) -> str:
    ops = [o for o in load_ops(paths) if _state(paths, o) not in ENDED]
    if args.id or args.job or args.url:
        chosen = [
            o for o in ops if args.id == o.id or (args.job and o.job_id == args.job) or (args.url and o.url == args.url)
        ]
        if not chosen:
            raise ScaleError(f"no running scale operation matches {args.id or args.job or args.url}; see `list`")
        engines = [e for o in chosen for e in o.engine_ids()]
    else:
        registered = {r.engine_id for r in read_records(paths.engines)}
        elastic = [e for o in reversed(ops) for e in reversed(o.engine_ids()) if e in registered]
        if len(elastic) < args.engines:
            raise ScaleError(
                f"only {len(elastic)} elastic engine(s) are registered; the run's own engines (engine-N) are not "
                "drained by scale in"
            )
        engines = elastic[: args.engines]
    drain(paths, engines, args.drain_timeout_s)
    for op in ops:
        if set(op.engine_ids()) <= set(engines):
            op.cancelled = True
            save_op(paths, op)
            if op.kind == "url":
                for record in read_records(paths.engines):
                    if record.engine_id == op.id:
                        remove_record(paths.engines, op.id, record.instance)
            elif (
                op.job_id
                and not op.job_id.startswith("local:")
                and (queue_state(op.job_id) or "").startswith("PENDING")
            ):
                subprocess.run(["scancel", op.job_id], check=False, timeout=60)
    if not _left(paths, engines, LEAVE_TIMEOUT_S):
        return (
            f"drained {len(engines)} engine(s): {', '.join(engines)}; still registered after {LEAVE_TIMEOUT_S:.0f} s "
            "(`list` shows them draining until their processes exit)"
        )
    return f"drained {len(engines)} engine(s): {', '.join(engines)}; they have left"


def _left(paths: RunPaths, engines: list[str], timeout_s: float) -> bool:
    """Whether the drained engines' processes deregistered within `timeout_s` (an elastic job
    stops its engines once it sees the operation cancelled: within seconds)."""
    deadline = time.monotonic() + timeout_s
    while any(r.engine_id in engines for r in read_records(paths.engines)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


LEAVE_TIMEOUT_S = 60.0  # how long `scale in` waits for drained engines to deregister


def drain(paths: RunPaths, engines: list[str], timeout_s: float) -> None:
    """No new requests to `engines`; wait for those in flight (the driver's heartbeat says how
    many), abort what is left at the deadline (the driver re-issues it), then let them go."""
    for engine_id in engines:
        marker = paths.drain_marker(engine_id)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("draining\n")
    deadline = time.monotonic() + timeout_s
    time.sleep(6.0)  # a driver heartbeat (every 5 s) that no longer counts them as eligible
    while time.monotonic() < deadline and any(in_flight(paths).get(e, 0) for e in engines):
        time.sleep(1.0)
    token = paths.read_token()
    for record in read_records(paths.engines):
        if record.engine_id in engines and in_flight(paths).get(record.engine_id, 0):
            with contextlib.suppress(EngineUnavailable, EngineRequestError):  # gone already: its work is re-issued
                EngineClient(record.url, token, 10.0).post(R.ABORT_REQUEST.path, P.AbortReq(abort_all=True))
    for engine_id in engines:
        paths.drain_marker(engine_id).write_text("done\n")


def listing(paths: RunPaths, as_json: bool) -> str:
    rows = [
        {"id": o.id, "kind": o.kind, "engines": len(o.engine_ids()), "where": o.job_id or o.url,
         "state": _state(paths, o)}
        for o in load_ops(paths)
    ]  # fmt: skip
    if as_json:
        return json.dumps(rows, indent=1)
    if not rows:
        return "no scale operations"
    return "\n".join(f"{r['id']:10} {r['kind']:6} {r['engines']} engine(s)  {r['where']:24} {r['state']}" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    # `serve` (how the local executor starts elastic engines) is left out of the help: a parser
    # added without help= is not listed, and the metavar names only the user's commands.
    sub = parser.add_subparsers(dest="command", required=True, metavar="{out,in,list}")
    out = sub.add_parser("out", help="add engines")
    what = out.add_mutually_exclusive_group(required=True)
    what.add_argument("--engines", type=int, help="engines of a new elastic job")
    what.add_argument("--url", help="a running SGLang server to add")
    out.add_argument("--id", help="the operation's name (repeating it does nothing)")
    out.add_argument("--dry-run", action="store_true", help="show the elastic job's submission file; submit nothing")
    out.add_argument("overrides", nargs="*", metavar="launch.slurm.KEY=VALUE")
    leave = sub.add_parser("in", help="drain engines")
    which = leave.add_mutually_exclusive_group(required=True)
    which.add_argument("--engines", type=int, help="the N most recently added engines")
    which.add_argument("--job", help="every engine of this elastic job")
    which.add_argument("--url", help="this external server")
    which.add_argument("--id", help="every engine of this operation")
    leave.add_argument("--drain-timeout-s", type=float, default=60.0)
    show = sub.add_parser("list", help="every scale operation and its state")
    show.add_argument("--json", action="store_true")
    serving = sub.add_parser("serve")
    serving.add_argument("op_id")
    args = parser.parse_args()
    paths = RunPaths(args.run_dir)
    if not paths.config.is_file():
        raise SystemExit(f"error: {args.run_dir} is not a relax_hpc run (no config.yaml)")
    try:
        if args.command == "out":
            print(scale_out(paths, args))
        elif args.command == "in":
            print(scale_in(paths, args))
        elif args.command == "list":
            print(listing(paths, args.json))
        else:
            op = next(o for o in load_ops(paths) if o.id == args.op_id)
            serve(read_frozen(paths.config), paths, op, lambda: False)
    except (ScaleError, ConfigError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    cli.run(main)
