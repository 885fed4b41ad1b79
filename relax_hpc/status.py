"""Where a run stands, from RUN_DIR (and Slurm, when the run was submitted to it).

    python -m relax_hpc.status RUN_DIR            # once
    python -m relax_hpc.status RUN_DIR --watch    # every 5 s until the run ends (--watch 30: every 30 s)
    python -m relax_hpc.status RUN_DIR --json     # the same facts for scripts
    python -m relax_hpc.status PIPELINE_DIR       # a pipeline (relax_hpc.pipeline): every stage
    python -m relax_hpc.status RUN_DIR --clear-bad-nodes   # forget the nodes left out (launch.badnodes)

It works on a live run, a finished or stopped one, and one whose Slurm job is still pending: step
and total, reward, the last evaluation, samples/s, staleness, where the time of a step goes, each
engine's health, the launcher's starts and the roles' restarts with their causes, the Slurm job's
state (squeue; once ended, sacct or the controller's record), the last checkpoint, an ETA, the
GPU- and CPU-hours per role (metrics.accounting), the nodes left out as bad (launch.badnodes) and
the engines out of service because their weights differ from the trainer's (weights.verify_every).
It reads files and asks engines' /health; it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from relax_hpc import cli
from relax_hpc.ckpt.layout import latest_dir
from relax_hpc.config.load import read_frozen
from relax_hpc.fence import Lease, refused_writes
from relax_hpc.launch import badnodes
from relax_hpc.launch.causes import exit_cause
from relax_hpc.launch.follow import ACTIVE, ENDED, queue_state
from relax_hpc.launch.follow import slurm_state as ended_state
from relax_hpc.metrics import accounting
from relax_hpc.metrics.evaluation import finished, table
from relax_hpc.metrics.heartbeat import read_heartbeat
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import completed_steps, guard_reason, step_records
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import read_quarantine, read_records

RECENT = 20  # steps the rates and the ETA average over
STALE_S = 30.0  # a heartbeat this old has stopped (the launcher's and the driver's beat every 5 s)
TIME_PHASES = ("wait", "read", "fwd_bwd", "optimizer", "push", "checkpoint")


def slurm_state(job_id: str) -> str | None:
    """The job's state: squeue while it is queued or running, then Slurm's record of its end
    (accounting, else the controller's); None where Slurm knows nothing of it."""
    active = queue_state(job_id)
    if active and active != "UNKNOWN":
        return active
    return ended_state(job_id)


def engines(paths: RunPaths) -> list[dict[str, Any]]:
    """Each registered engine (rollout, then judge and teacher engines): where it listens, the
    weights it holds, whether it answers."""
    out = []
    for record in [r for folder in paths.registries for r in read_records(folder)]:
        client = EngineClient(record.url, api_key="", timeout_s=2.0)  # /health needs no key
        out.append(
            {"id": record.engine_id, "url": record.url, "weight_version": record.weight_version,
             "healthy": client.healthy(timeout_s=2.0)}
        )  # fmt: skip
    return out


def last_seen(paths: RunPaths) -> dict[str, Any] | None:
    """The run's newest heartbeat (the launcher's, the trainer's, the driver's: RUN_DIR/health),
    and whether every one of them has stopped: its writer is gone (a process of this host), or it
    is older than STALE_S (another host's)."""
    now = time.time()
    folder = paths.health("launcher").parent
    beats = {path.stem: beat for path in folder.glob("*.json") if (beat := read_heartbeat(path))}
    if not beats:
        return None
    role, newest = max(beats.items(), key=lambda item: float(item[1]["time"]))
    return {
        "time": newest["time"], "role": role, "pid": newest.get("pid"), "host": newest.get("host"),
        "stopped": all(_stopped(beat, now) for beat in beats.values()),
    }  # fmt: skip


def _stopped(beat: dict[str, Any], now: float) -> bool:
    if beat.get("host") == socket.gethostname():
        return _gone(int(beat["pid"]))
    return now - float(beat["time"]) > STALE_S


def _gone(pid: int) -> bool:
    """A process of this host has exited (a zombie too: killed roles wait for a parent to reap them)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _unrecorded_end(seen: dict[str, Any], events: list[dict[str, Any]], job: str | None) -> str:
    """A start without its end, whose job Slurm no longer knows (or that had none) and whose
    heartbeats stopped: ended, killed before its launcher could say so; when and how last seen."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seen["time"]))
    where = f" (pid {seen['pid']} on {seen['host']})" if seen.get("host") else ""
    said = [e["why"] for e in events[_last_start(events) :] if e.get("event") == "stop_requested"]
    return (
        "ended without its end record"
        + (f" (Slurm no longer knows job {job})" if job else "")
        + f": last seen {when} ({_duration(time.time() - seen['time'])} ago), the {seen['role']}'s heartbeat{where}"
        + (f"; the launcher's last word: {said[-1]}" if said else "; nothing said why (killed)")
    )


def _last_start(events: list[dict[str, Any]]) -> int:
    return max((i for i, e in enumerate(events) if e.get("event") == "start"), default=0)


def _state(
    paths: RunPaths, total: int, events: list[dict[str, Any]], slurm: str | None, job: str | None,
    seen: dict[str, Any] | None,
) -> str:  # fmt: skip
    if completed_steps(paths) >= total:
        return "complete"
    starts = [e for e in events if e.get("event") == "start"]
    ends = [e for e in events if e.get("event") == "end"]
    if slurm and slurm.startswith(("PENDING", "CONFIGURING", "REQUEUED")):
        return "pending (Slurm)"
    ended = slurm is not None and slurm.split()[0] not in ACTIVE
    if starts and (not ends or ends[-1]["time"] < starts[-1]["time"]):
        # A launcher killed with its job wrote no end: Slurm's word then says how it ended, and
        # once Slurm has forgotten the job (no accounting, MinJobAge) the stopped heartbeats do.
        if ended and slurm:
            return f"{ENDED.get(slurm.split()[0], slurm)} (Slurm: {slurm})"
        return _unrecorded_end(seen, events, job) if slurm is None and seen and seen["stopped"] else "running"
    if ends:
        return {0: "complete", 75: "stopped (resumable)"}.get(ends[-1]["exit"], "failed")
    return "not started"


def collect(run_dir: Path) -> dict[str, Any]:
    """Every fact `status` shows, as a dict."""
    paths = RunPaths(run_dir)
    if not paths.config.is_file():
        raise SystemExit(f"{run_dir} is not a relax_hpc run (no config.yaml)")
    cfg = read_frozen(paths.config)
    total = cfg.trainer.total_steps
    steps = step_records(paths)
    events = read_jsonl(paths.events_metrics)
    job = paths.slurm_job_id.read_text().strip() if paths.slurm_job_id.is_file() else None
    slurm = slurm_state(job) if job else None
    seen = last_seen(paths)
    facts: dict[str, Any] = {
        "run_dir": str(paths.root),
        "state": _state(paths, total, events, slurm, job, seen),
        "last_seen": seen,
        "step": steps[-1]["step"] if steps else 0,
        "total_steps": total,
        "checkpoint_step": completed_steps(paths),
        "slurm_job": job,
        "slurm_state": slurm,
        "engines": engines(paths),
        "starts": len([e for e in events if e.get("event") == "start"]),
        "role_exits": [e for e in events if e.get("event") == "role_exit"],
        "stops": [e["why"] for e in events if e.get("event") == "stop_requested"],
        # Writes refused by superseded processes (relax_hpc/fence.py): they ended without writing.
        "fencing": {"generation": Lease(paths.root).generation, "refused_writes": len(refused_writes(paths.root))},
        "guard": guard_reason(paths),
        "bad_nodes": _bad_nodes(events, cfg.launch.slurm.bad_node_failures),
        "weights_check": _weights_check(paths, events),
    }
    facts["usage"] = accounting.accounting(paths, live=facts["state"] == "running")
    checkpoint = latest_dir(paths.ckpt)
    if checkpoint is not None:
        facts["checkpoint"] = str(checkpoint)
        facts["checkpoint_age_s"] = time.time() - checkpoint.stat().st_mtime
    evals = [r for r in read_jsonl(paths.eval_metrics) if "greedy_accuracy" in r]
    if evals:
        facts["eval"] = {"version": evals[-1]["version"], "greedy_accuracy": evals[-1]["greedy_accuracy"]}
    if steps:
        facts.update(_rates(steps, total))
    if cfg.kind == "eval":
        facts.update(_eval_facts(paths, {(m.name, d.name) for m in cfg.eval.models for d in cfg.eval.datasets}))
        facts["state"] = "complete" if facts["pairs_scored"] == facts["pairs"] else facts["state"]
    return facts


def _bad_nodes(events: list[dict[str, Any]], threshold: int) -> dict[str, Any]:
    """Failed roles per node, the nodes that count as bad, and the exclude list last set."""
    excluded = [e for e in events if e.get("event") in ("nodes_excluded", "nodes_not_excluded", "bad_nodes_cleared")]
    return {
        "failures": dict(badnodes.failures(events)),
        "bad": badnodes.bad_nodes(events, threshold),
        "excluded": excluded[-1].get("nodes", []) if excluded else [],
    }


def _weights_check(paths: RunPaths, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The engines out of service because their weights differ from the trainer's (weights.
    verify_every), and the last mismatch and recovery the run recorded."""
    checks = [e for e in events if e.get("event") in ("weights_mismatch", "weights_recovered")]
    held = [asdict(m) for m in read_quarantine(paths.weights_quarantine).values()]
    mismatches = [e for e in checks if e["event"] == "weights_mismatch"]
    return {"held_out": held, "mismatches": len(mismatches), "last": checks[-1] if checks else None}


def _weights_line(check: dict[str, Any]) -> str | None:
    if check["held_out"]:
        return "weights:     " + "; ".join(
            f"engine {m['engine_id']} OUT OF SERVICE since v{m['version']}: {m['differ']} of {m['checked']} tensors "
            f"differ from the trainer's ({', '.join(m['tensors'][:2])}); back once a push matches it"
            for m in check["held_out"]
        )
    last = check["last"]
    if last is None:
        return None
    what = "back" if last["event"] == "weights_recovered" else "differed"
    return (
        f"weights:     no engine held out; {check['mismatches']} mismatch(es) so far, the last: "
        f"engine {last['engine']} {what} at v{last['version']}"
    )


def _eval_facts(paths: RunPaths, wanted: set[tuple[str, str]]) -> dict[str, Any]:
    """An eval job's progress: the model x dataset pairs its record holds, and its tables."""
    records = read_jsonl(paths.eval_results)
    return {"pairs": len(wanted), "pairs_scored": len(finished(paths) & wanted), "eval_table": table(records)}


def _rates(steps: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Reward, throughput, staleness, time breakdown and ETA over the last steps of the latest
    start (a gap across a restart is no step time)."""
    recent = steps[-RECENT:]
    last = recent[-1]
    score = "reward" if "reward" in last else "loss"  # an sft run's steps have a loss only
    out: dict[str, Any] = {
        score: last[score],
        f"{score}_mean10": statistics.fmean(r[score] for r in steps[-10:]),
        "staleness_mean": last.get("staleness_mean", 0.0),
        "last_step_age_s": time.time() - last["time"],
    }
    timed = [r for r in recent if "time_step" in r]
    if timed:
        step_s = statistics.fmean(r["time_step"] for r in timed)
        out["seconds_per_step"] = step_s
        out["samples_per_s"] = sum(r["samples"] for r in timed) / max(sum(r["time_step"] for r in timed), 1e-9)
        out["eta_s"] = max(0, total - last["step"]) * step_s
        out["time"] = {p: statistics.fmean(r[f"time_{p}"] for r in timed) for p in (*TIME_PHASES, "generate")}
        out["overlap_gain"] = statistics.fmean(r["overlap_gain"] for r in timed)
        out["overlap_bound"] = statistics.fmean(r["overlap_bound"] for r in timed)
    return out


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _role_exit(event: dict[str, Any]) -> str:
    """A role's exit by its cause (hung, fenced, a signal, the exit code), its node, and the node's
    fault where the launcher found one (launch.badnodes); events written before the launcher
    recorded the cause get it from their exit status."""
    cause = event.get("cause") or exit_cause(event["exit"], event.get("hung"))
    nodes = f" on {','.join(event['nodes'])}" if event.get("nodes") else ""
    fault = event.get("node_fault")
    node = f"; node {fault['node']}: {fault['cause']}" if fault else ""
    return f"{event['role']}: {cause}{nodes}{node} ({event['action']})"


def render(facts: dict[str, Any]) -> str:
    """The facts as a few aligned lines."""
    lines = [f"run:         {facts['run_dir']}", f"state:       {facts['state']}"]
    progress = f"step {facts['step']}/{facts['total_steps']}"
    if "pairs" in facts:  # an eval job
        progress = f"{facts['pairs_scored']}/{facts['pairs']} model x dataset pairs scored"
    if "eta_s" in facts and facts["state"] == "running":
        progress += f", ETA {_duration(facts['eta_s'])} at {facts['seconds_per_step']:.2f} s/step"
    lines.append(f"progress:    {progress}")
    lines += [
        f"{score + ':':<13}{facts[score]:.3f} (last step), {facts[f'{score}_mean10']:.3f} (mean of 10)"
        for score in ("reward", "loss")  # an sft run has a loss, an RL run a reward
        if score in facts
    ]
    if "eval" in facts:
        lines.append(
            f"eval:        greedy accuracy {facts['eval']['greedy_accuracy']:.3f} at version {facts['eval']['version']}"
        )
    if "samples_per_s" in facts:
        lines.append(
            f"throughput:  {facts['samples_per_s']:.0f} samples/s, staleness {facts['staleness_mean']:.2f} "
            f"(last {RECENT} steps)"
        )
        t = facts["time"]
        parts = " + ".join(f"{p} {t[p]:.2f}" for p in TIME_PHASES)
        lines.append(
            f"time/step:   {facts['seconds_per_step']:.2f} s = {parts}; generate {t['generate']:.2f} s; "
            f"overlap {facts['overlap_gain']:.2f}x of at most {facts['overlap_bound']:.2f}x"
        )
    for engine in facts["engines"]:
        health = "healthy" if engine["healthy"] else "NOT ANSWERING"
        lines.append(f"engine:      {engine['id']} {engine['url']} weights v{engine['weight_version']} {health}")
    exits = facts["role_exits"]
    lines.append(
        f"starts:      {facts['starts']}" + (f"; stops asked: {'; '.join(facts['stops'])}" if facts["stops"] else "")
    )
    lines += [f"restart:     {_role_exit(e)}" for e in exits[-5:]]
    if "weights_check" in facts and (weights := _weights_line(facts["weights_check"])) is not None:
        lines.append(weights)
    if "checkpoint" in facts:
        lines.append(f"checkpoint:  {facts['checkpoint']} ({_duration(facts['checkpoint_age_s'])} ago)")
    fencing = facts["fencing"]
    lines.append(
        f"fencing:     generation {fencing['generation']}, "
        f"{fencing['refused_writes']} write(s) refused to superseded processes"
    )
    if facts["slurm_job"]:
        known = facts["slurm_state"] or "unknown to Slurm (squeue, sacct, scontrol)"
        lines.append(f"slurm:       job {facts['slurm_job']}: {known}")
    if facts["guard"]:
        lines.append(f"guard:       {facts['guard']}")
    lines += accounting.render(facts["usage"])
    nodes = facts["bad_nodes"]
    if nodes["failures"]:
        counts = ", ".join(f"{node} {n}" for node, n in sorted(nodes["failures"].items()))
        lines.append(
            f"bad nodes:   {', '.join(nodes['bad']) or 'none'} (failed roles per node: {counts}); "
            f"excluded from the job: {', '.join(nodes['excluded']) or 'none'}"
        )
    if facts.get("eval_table"):
        lines.append("\n" + facts["eval_table"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="the run's RUN_DIR (run.dir), or a pipeline's directory")
    parser.add_argument(
        "--watch", type=float, nargs="?", const=5.0, metavar="SECONDS", help="repeat until the run ends"
    )
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    parser.add_argument(
        "--clear-bad-nodes",
        action="store_true",
        help="forget the run's bad nodes (and empty a pending job's exclude list)",
    )
    args = parser.parse_args(argv)
    if args.clear_bad_nodes:
        paths = RunPaths(args.run_dir)
        if not paths.config.is_file():
            raise SystemExit(f"{args.run_dir} is not a relax_hpc run (no config.yaml)")
        print(badnodes.clear(paths))
        return 0
    from relax_hpc import pipeline

    while True:
        if pipeline.is_pipeline(args.run_dir):  # a PIPELINE_DIR: every stage
            facts = pipeline.status(args.run_dir)
            text = json.dumps(facts, indent=1) if args.json else pipeline.render(facts)
            live = not facts["stopped"] and any(r["state"] != "done" for r in facts["stages"])
        else:
            facts = collect(args.run_dir)
            text = json.dumps(facts, indent=1) if args.json else render(facts)
            live = facts["state"] in ("running", "pending (Slurm)", "not started")
        if args.watch and sys.stdout.isatty():
            sys.stdout.write("\033[H\033[J")  # redraw in place
        print(text, flush=True)
        if not args.watch or not live:
            return 0
        time.sleep(args.watch)


if __name__ == "__main__":
    cli.run(main)
