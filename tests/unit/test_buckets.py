"""Weight-sync buckets: planning by size and dtype; uint8 flattening and splitting (SGLang's
"flattened_bucket" layout); the double-buffered packer; push's side of a rank without a sender and
its pipelined requests."""

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch

from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineRequestError, RequestPipeline
from relax_hpc.weights.buckets import BucketPacker, BucketPlan, BufferRing, assign, pack, plan_buckets, unpack
from relax_hpc.weights.sender import push


def test_buckets_respect_size_and_dtype_and_keep_order():
    specs = [
        ("a", torch.Size([4, 4]), torch.float32),  # 64 bytes
        ("b", torch.Size([8]), torch.float32),  # 32
        ("c", torch.Size([10]), torch.float32),  # 40 -> would exceed 100 bytes: new bucket
        ("d", torch.Size([3]), torch.bfloat16),  # dtype change: new bucket
        ("e", torch.Size([100]), torch.float32),  # larger than a bucket: travels alone
    ]
    plans = plan_buckets(specs, max_bytes=100)
    assert [p.names for p in plans] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [p.nbytes for p in plans] == [96, 40, 6, 400]
    assert plans[2].dtypes == ["bfloat16"] and plans[0].shapes == [[4, 4], [8]]


def test_a_bucket_never_spans_two_keys():
    """The sharded channel's plan: a bucket holds tensors of one pipeline stage only."""
    specs = [(f"p{i}", torch.Size([4]), torch.float32) for i in range(6)]
    stage = {"p0": 0, "p1": 0, "p2": 1, "p3": 1, "p4": 1, "p5": 1}
    plans = plan_buckets(specs, 2**20, key=stage.__getitem__)
    assert [p.names for p in plans] == [["p0", "p1"], ["p2", "p3", "p4", "p5"]]
    assert [p.names for p in plan_buckets(specs, 2**20)] == [[f"p{i}" for i in range(6)]]


def test_buckets_are_spread_over_their_candidates_by_size():
    sizes = [[1000], [10], [600], [500], [20]]
    plans = [BucketPlan([f"p{i}"], ["float32"], [s]) for i, s in enumerate(sizes)]
    owner = assign(plans, [range(2)] * len(plans))
    load = [sum(p.nbytes for p, o in zip(plans, owner, strict=True) if o == r) for r in range(2)]
    assert sorted(load) == [4120, 4400]  # largest first, each to the lighter rank
    # Each bucket goes to one of the ranks that hold it (a stage's ranks): 0 and 1 hold the first
    # two, 2 and 3 the rest.
    owner = assign(plans, [[0, 1], [0, 1], [2, 3], [2, 3], [2, 3]])
    assert owner == [0, 1, 2, 3, 3]


def test_pack_unpack_round_trip_is_bit_exact():
    tensors = {"x": torch.randn(3, 5), "y": torch.randn(7), "z": torch.tensor(2.5)}
    plan = plan_buckets([(n, t.shape, t.dtype) for n, t in tensors.items()], max_bytes=1 << 20)[0]
    flat = pack(list(tensors.values()))
    assert flat.dtype == torch.uint8 and flat.numel() == plan.nbytes == 4 * 23
    for name, tensor in unpack(flat.clone(), plan):
        assert torch.equal(tensor, tensors[name]) and tensor.shape == tensors[name].shape


def test_bf16_bucket_round_trip():
    t = torch.randn(9).to(torch.bfloat16)
    plan = plan_buckets([("w", t.shape, t.dtype)], 1 << 20)[0]
    ((name, back),) = unpack(pack([t]), plan)
    assert name == "w" and back.dtype == torch.bfloat16 and torch.equal(back, t)


def _buckets(seed: int = 0) -> list[list[torch.Tensor]]:
    """Buckets of several sizes and dtypes, with a non-contiguous tensor and a 0-dim one."""
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(5, 7, generator=g), torch.randn(3, generator=g)],
        [torch.randn(6, 4, generator=g).t(), torch.tensor(1.5)],
        [torch.randn(33, generator=g).to(torch.bfloat16)],
        [torch.randn(2, 2, generator=g), torch.randn(50, generator=g)],  # the largest: 216 bytes
        [torch.randn(1, generator=g)],
    ]


def test_double_buffered_packer_gives_the_bytes_of_pack_in_two_buffers():
    buckets = _buckets()
    packer = BucketPacker(torch.device("cpu"), capacity=max(pack(b).numel() for b in buckets))
    buffers = set()
    for tensors in buckets:
        flat = packer.pack(tensors)
        assert flat.dtype == torch.uint8 and torch.equal(flat, pack(tensors))
        buffers.add(flat.untyped_storage().data_ptr())
        packer.consumed(None)
    packer.drain()
    assert len(buffers) == 2


class _SlowConsumer:
    """Reads each packed buffer some time after pack() returned it, on a thread of its own, like a
    broadcast on the wire; its fence is set when it is done with the buffer."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.log: list[tuple[str, int]] = []  # ("packed" | "consumed", bucket index), in time order
        self.lock = threading.Lock()

    def consume(self, i: int, flat: torch.Tensor) -> tuple[threading.Event, Future]:
        done = threading.Event()

        def read() -> torch.Tensor:
            time.sleep(0.05)
            seen = flat.clone()
            with self.lock:
                self.log.append(("consumed", i))
            done.set()
            return seen

        return done, self.pool.submit(read)


def test_double_buffered_packer_waits_for_the_consumer_before_reusing_a_buffer():
    buckets = _buckets(1)
    packer = BucketPacker(torch.device("cpu"), capacity=216)
    consumer = _SlowConsumer()
    reads = []
    for i, tensors in enumerate(buckets):
        flat = packer.pack(tensors)
        with consumer.lock:
            consumer.log.append(("packed", i))
        done, read = consumer.consume(i, flat)
        packer.consumed(done)
        reads.append(read)
    packer.drain()
    # Every consumer saw its own bucket's bytes: no buffer was packed again while being read.
    assert all(torch.equal(read.result(timeout=10), pack(t)) for read, t in zip(reads, buckets, strict=True))
    # Bucket i+2 (same buffer as bucket i) was packed only after bucket i was consumed.
    order = consumer.log
    for i in range(len(buckets) - 2):
        assert order.index(("consumed", i)) < order.index(("packed", i + 2)), order
    assert order.index(("packed", 1)) < order.index(("consumed", 0))  # two in flight: real overlap


def test_buffer_ring_grows_a_buffer_for_a_larger_bucket():
    ring = BufferRing(torch.device("cpu"), capacity=8)
    for nbytes in (8, 4, 20, 3):
        flat = ring.acquire(nbytes)
        assert flat.numel() == nbytes and flat.dtype == torch.uint8
        ring.release(None)


def test_push_on_a_rank_without_a_sender_walks_every_parameter_and_ignores_none():
    plans = plan_buckets([(n, torch.Size([4]), torch.float32) for n in "abc"], max_bytes=32)
    walked = []

    def full_parameters():
        for name in "abc":
            walked.append(name)
            yield name, None

    assert push(None, plans, full_parameters, version=3) == 0
    assert walked == ["a", "b", "c"]


class _InOrderHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the built-in engine
    seen: ClassVar[list[str]] = []  # shared by every handler instance: the server makes one per connection

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(self.path)
        time.sleep(0.02 if self.path == "/slow" else 0)
        body = json.dumps({"path": self.path}).encode()
        self.send_response(400 if self.path == "/bad" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_request_pipeline_sends_ahead_and_reads_answers_in_order():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _InOrderHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pipeline = RequestPipeline(f"http://127.0.0.1:{server.server_address[1]}", "token", timeout_s=10)
        for route in ("/slow", "/a", "/bad", "/b"):
            pipeline.send(route, P.EndWeightUpdateReqInput())  # none waits for an answer
        pipeline.wait_answers(leave=2)  # /slow and /a
        with pytest.raises(EngineRequestError, match="/bad: HTTP 400"):
            pipeline.wait_answers()
        pipeline.close()
    finally:
        server.shutdown()
    assert _InOrderHandler.seen == ["/slow", "/a", "/bad", "/b"]
