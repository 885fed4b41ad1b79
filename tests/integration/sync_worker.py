"""Stand-in trainer for test_weight_sync, two ranks forked after one import as the trainer on the
CPU forks its own (relax_hpc.trainer.ranks; torchrun would import everything once per rank):
perturb the sharded model, push it through the weight channel (relax_hpc.weights.channel) the
path names, record what to expect.

argv: run dir, output file, version, and the path: "broadcast" (rank 0 broadcasts to every engine),
"colocated" (each rank releases its own engines' memory first, then hands them the weights by
reference), "adapter" (trainer.lora.sync adapter: rank 0 writes PEFT folders the engines load;
two versions, the first one's greedy answers recorded too) or "file" (weights.channel file, the
run's config says whether with weights.delta: then six versions, the second engine missing one
and killed during another, see push_files). With
trainer.lora in the run's config only the adapters are perturbed and sent, and what to expect is
the base with the adapters merged (relax_hpc.weights.lora)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import FileWeights, JobConfig
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.supervisor import child_env
from relax_hpc.metrics.timing import PhaseTimer
from relax_hpc.models.lora import write_adapter_folder
from relax_hpc.models.tiny import addition_problems
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.protocol.requests import GenerateReqInput
from relax_hpc.trainer.backend import BackendConfig
from relax_hpc.trainer.build import build_channel
from relax_hpc.trainer.torch_backend import TorchBackend
from relax_hpc.weights.adapters import AdapterChannel, AdapterPublisher
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.channel import WeightChannel
from relax_hpc.weights.colocated import ColocatedChannel, ColocatedSender
from relax_hpc.weights.files import FileChannel
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.lora import merge_all
from relax_hpc.weights.sender import BroadcastChannel, WeightSender, WeightSyncError
from relax_hpc.weights.sharded import ShardedChannel, ShardedColocatedChannel, shares


def main() -> None:
    paths, out, version, path = RunPaths(Path(sys.argv[1])), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = read_frozen(paths.config)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    backend = TorchBackend(BackendConfig.of(cfg), torch.device("cpu"))
    perturb(backend.model)
    buckets = plan_buckets(backend.parameter_specs(), int(cfg.weights.bucket_mb * 2**20))
    channel = make_channel(path, cfg, paths, backend, rank)
    timer, refused, previous = PhaseTimer(), None, None
    pushes = {"file": push_files, "sharded": push_sharded}
    pushed_files = pushes[path](channel, cfg, paths, backend, version) if path in pushes else Pushed()
    served = pushed_files.served
    engines = served[-1] if served else 0
    # Adapter and colocated: two versions of different weights; the engine holds the second
    # exactly, and (adapter) a request naming the first is answered with it after the second's load.
    twice = ("adapter", "colocated", "sharded-colocated")
    for pushed in (version - 1, version) if path in twice else () if path in pushes else (version,):
        if pushed == version and path in twice:
            previous = dict(backend.full_parameters()) if path == "adapter" else None
            perturb(backend.model)
        channel.before_step(timer)  # colocated: the engines release their memory
        if isinstance(channel, ColocatedChannel):
            refused = all(refuses_generation(r.url, paths.read_token()) for r in channel.sender.engines())
        engines = channel.push(backend.full_parameters, pushed)
    full = dict(backend.full_parameters())
    if rank == 0:
        full, greedy = expected(cfg.model.path, cfg.trainer.lora is not None, full)
        # Every weight, bit for bit: what every engine must hold (its snapshot route tells).
        save_file({n: t.detach().clone() for n, t in full.items()}, str(out.with_suffix(".safetensors")))
        out.write_text(
            json.dumps(
                {
                    "engines": engines,
                    "served": served,
                    "restarted": pushed_files.restarted,
                    "refused_s": pushed_files.refused_s,
                    "killed_s": pushed_files.killed_s,
                    "folders": sorted(p.name for p in paths.weight_files.iterdir()) if path == "file" else None,
                    "refused_while_released": refused,
                    "buckets": len(buckets),
                    "largest_tensor": max(t.numel() * t.element_size() for t in full.values()),
                    "shares": shares(channel.buckets, channel.owner, dist.get_world_size())
                    if isinstance(channel, ShardedChannel | ShardedColocatedChannel)
                    else None,
                    "relayed_groups": len(channel.sender.relayed)
                    if isinstance(channel, ShardedChannel) and channel.sender is not None
                    else None,
                    "bytes": sum(b.nbytes for b in buckets),
                    "bucket_bytes": [b.nbytes for b in buckets],
                    "greedy": greedy,
                    "previous_greedy": None if previous is None else expected(cfg.model.path, True, previous)[1],
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Pushed:
    served: list[int] = field(default_factory=list)  # engines each push served
    restarted: int | None = None  # the pid of the engine started again
    refused_s: float | None = None  # the sharded push that could not open: its slowest rank's failure
    killed_s: float | None = None  # the sharded push whose engine was killed: its slowest rank's failure


def push_files(channel: WeightChannel, cfg: JobConfig, paths: RunPaths, backend: TorchBackend, version: int) -> Pushed:
    """Two versions through the file channel; with weights.delta six, each a sparse change of the
    one before: the second engine is stopped during the third push (it misses it) and killed as the
    fifth is written and loaded, then started again (as the launcher would) for the sixth."""
    second, delta = None, isinstance(cfg.weights, FileWeights) and cfg.weights.delta
    if dist.get_rank() == 0 and delta:
        second = sorted(read_records(paths.engines), key=lambda r: r.engine_id)[1]
    out = Pushed()
    for pushed in range(version - (5 if delta else 1), version + 1):
        if out.served:
            perturb(backend.model, share=0.02)
        if second is not None and pushed == version - 3:
            os.kill(second.pid, signal.SIGSTOP)
        killer = None
        if second is not None and pushed == version - 1:
            assert isinstance(channel, FileChannel), "the file path builds a FileChannel"
            killer = kill_after_decision(channel, second.pid)
        out.served.append(channel.push(backend.full_parameters, pushed))
        if second is not None and pushed == version - 3:
            os.kill(second.pid, signal.SIGCONT)
        if second is not None and killer is not None:
            killer.join()
            out.restarted = restart(cfg, paths, second)
        dist.barrier()
    return out


def push_sharded(
    channel: WeightChannel, cfg: JobConfig, paths: RunPaths, backend: TorchBackend, version: int
) -> Pushed:
    """Four versions through the sharded channel. The first cannot open (rank 0 finds an engine
    unreachable as it opens the push), which fails it on both ranks at once (`refused_s`: the
    slowest rank's time to the failure), not after weights.timeout_s. The third: the second engine
    is killed (-9) as the push begins (rank 0 has paused the engines; the buckets, half of them
    rank 1's, are due), which fails that push on every rank within seconds (`killed_s`: every
    rank watches the engines, so none waits out weights.timeout_s for a root that gave up);
    started again (as the launcher would), it missed that version and takes the fourth with the
    first engine."""
    assert isinstance(channel, ShardedChannel), "the sharded path builds a ShardedChannel"
    second = None
    if dist.get_rank() == 0:
        second = sorted(read_records(paths.engines), key=lambda r: r.engine_id)[1]
        unreachable_once(channel)
    out = Pushed()
    for pushed in (version - 3, version - 2, version - 1, version):
        if out.served:
            perturb(backend.model)
        if second is not None and pushed == version - 1:
            kill_once_begun(channel, second.pid)
        started = time.monotonic()
        try:
            out.served.append(channel.push(backend.full_parameters, pushed))
        except WeightSyncError:
            out.served.append(-1)  # on every rank
            took: list[float] = [0.0] * dist.get_world_size()
            dist.all_gather_object(took, time.monotonic() - started)
            if pushed == version - 3:
                out.refused_s = max(took)
            elif pushed == version - 1:
                out.killed_s = max(took)
        if second is not None and pushed == version - 1:
            out.restarted = restart(cfg, paths, second)
        dist.barrier()
    return out


def unreachable_once(channel: ShardedChannel) -> None:
    """Rank 0's next open_push fails as a vanished engine's connection does (once)."""
    assert channel.sender is not None, "every rank sends"
    sender = channel.sender
    open_push = sender.open_push

    def refused() -> None:
        sender.open_push = open_push  # type: ignore[method-assign]  # once
        raise EngineUnavailable("engine-1: connection refused (injected)")

    sender.open_push = refused  # type: ignore[method-assign]


def kill_once_begun(channel: ShardedChannel, pid: int) -> None:
    """Kill the engine right after rank 0 queued pause and begin (once): a fault at that point,
    the channel running as it is."""
    assert channel.sender is not None, "every rank sends"
    sender = channel.sender
    open_push = sender.open_push

    def opened() -> None:
        open_push()
        os.kill(pid, signal.SIGKILL)
        sender.open_push = open_push  # type: ignore[method-assign]  # once

    sender.open_push = opened  # type: ignore[method-assign]


def kill_after_decision(channel: FileChannel, pid: int) -> threading.Thread:
    """Once the push has asked the engines which version they hold (the engine is in it), stop
    the engine (its load then waits) and kill it while the push writes and loads; the thread ends
    with the kill. A fault injected at that point, not a stand-in: the channel runs as it is."""
    decided = threading.Event()
    decide = channel._decide

    def deciding(version: int) -> object:
        decision = decide(version)
        os.kill(pid, signal.SIGSTOP)
        decided.set()
        channel._decide = decide  # type: ignore[method-assign]  # once
        return decision

    def kill() -> None:
        decided.wait()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)

    channel._decide = deciding  # type: ignore[method-assign,assignment]
    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def restart(cfg: JobConfig, paths: RunPaths, record: EngineRecord) -> int:
    """Start the engine again from the launcher's command line; its pid once it answers."""
    log = (paths.root / f"{record.engine_id}-restarted.log").open("ab")
    proc = subprocess.Popen(
        local_commands(cfg, paths)[record.engine_id], stdout=log, stderr=subprocess.STDOUT, env=child_env(cfg)
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [
            r for r in read_records(paths.engines) if r.engine_id == record.engine_id and r.instance != record.instance
        ]
        if new and EngineClient(new[0].url, paths.read_token(), 5.0).healthy():
            return proc.pid
        time.sleep(0.2)
    raise TimeoutError(f"{record.engine_id} did not come back")


def make_channel(path: str, cfg: JobConfig, paths: RunPaths, backend: TorchBackend, rank: int) -> WeightChannel:
    """The channel `path` names, built as relax_hpc.trainer.build builds it for a run."""
    token, bucket_bytes = paths.read_token(), int(cfg.weights.bucket_mb * 2**20)
    layout = EngineLayout(backend.parameter_specs(), None)
    if path in ("file", "sharded", "sharded-colocated"):  # as a run builds it (its config says which)
        return build_channel(cfg, paths, backend, torch.device("cpu"))
    if path == "adapter":
        lora = cfg.trainer.lora
        assert lora is not None, "the adapter path is a LoRA run's"
        write = lambda out, adapter: write_adapter_folder(out, lora, cfg.model.path, adapter)  # noqa: E731
        return AdapterChannel(
            AdapterPublisher(paths.engines, paths.lora_adapters, write, token, 30.0) if rank == 0 else None
        )
    if path == "colocated":
        return ColocatedChannel(
            ColocatedSender(paths.engines, token, 30.0, rank, dist.get_world_size()), layout, bucket_bytes
        )
    return BroadcastChannel(
        WeightSender(paths.engines, token, "gloo", 30.0) if rank == 0 else None, layout, bucket_bytes
    )


def expected(model_path: str, lora: bool, full: dict) -> tuple[dict, list[list[int]]]:
    """The engine's weights, every one (LoRA: the base with the adapters merged, the untouched
    base tensors too), and their greedy answers."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    reference = AutoModelForCausalLM.from_pretrained(model_path).eval()
    reference.load_state_dict(merge_all(reference.state_dict(), full) if lora else full, strict=False)
    if lora:  # named_parameters: a tied head once, under the embedding's name, as the engines hold it
        full = {name: p.detach().clone() for name, p in reference.named_parameters()}
    prompts = [tokenizer(p)["input_ids"] for p, _ in addition_problems()]
    spec = SamplingSpec(max_new_tokens=4, temperature=0.0)
    n = len(prompts)
    greedy = sample(reference, prompts, [spec] * n, [None] * n, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return full, [c.output_ids for c in greedy]


def perturb(model: torch.nn.Module, share: float = 1.0) -> None:
    """Change every trainable element, or about `share` of them."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # LoRA: the adapters (B starts at zero), never the frozen base
                p.add_(0.3 * torch.randn_like(p) * (torch.rand_like(p) < share))


def refuses_generation(url: str, token: str) -> bool:
    """A released engine answers /generate with 503 (busy) rather than from emptied weights."""
    try:
        EngineClient(url, token, 10.0).generate(
            GenerateReqInput(input_ids=[[1, 2]], sampling_params={"max_new_tokens": 1})
        )
    except EngineUnavailable as e:
        return "HTTP 503" in str(e)
    return False


if __name__ == "__main__":
    from relax_hpc.trainer.ranks import run_ranks

    sys.exit(run_ranks(int(sys.argv[5]) if len(sys.argv) > 5 else 2, main))
