"""A stand-in for `python -m sglang.launch_server` where SGLang cannot run (no GPU).

    rollout.sglang.module=tests.integration.fake_sglang_server   (run from the repository root)

It parses its arguments with SGLang's own parser (ServerArgs.add_cli_args of the pinned release),
so an argument that launch_server would refuse fails here too, and then serves the built-in torch
engine's HTTP API (relax_hpc.engines.torch_engine's engine and request handler) on --host/--port
with --api-key as the key and --weight-version as the starting version. Like SGLang, it writes
nothing to RUN_DIR: registering is the wrapper's job.

With FAKE_SGLANG_NEVER_HEALTHY=1 in its environment it never listens: a server stuck loading.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from http.server import ThreadingHTTPServer

import torch

from relax_hpc.engines.torch_engine import TorchEngine, _Handler
from tests.sglang_import import import_sglang

NEVER_HEALTHY = "FAKE_SGLANG_NEVER_HEALTHY"


def parse_args() -> argparse.Namespace:
    (server_args,) = import_sglang("sglang.srt.server_args")
    parser = argparse.ArgumentParser(prog="sglang.launch_server (relax_hpc's test stand-in)")
    server_args.ServerArgs.add_cli_args(parser)
    return parser.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fake-sglang %(levelname)s %(message)s")
    if os.environ.get(NEVER_HEALTHY) == "1":
        while True:
            time.sleep(60)
    args = parse_args()
    torch.set_num_threads(1)
    engine = TorchEngine(args.model_path, "float32" if args.dtype in ("auto", "float") else args.dtype)
    engine.weight_version = args.weight_version
    settings = {"engine": engine, "api_key": args.api_key}
    server = ThreadingHTTPServer((args.host, args.port), type("Handler", (_Handler,), settings))
    server.daemon_threads = True
    logging.getLogger("fake_sglang").info(
        "serving %s on %s:%d (tp_size %d)", args.model_path, args.host, args.port, args.tp_size
    )
    server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
