"""A program for the fork server's tests: prints what it was given, then sleeps or exits.

python -m tests.unit.fork_child [--sleep S] [--exit N] [--raise]
Its import takes FORK_TEST_IMPORT_S seconds (a server's slow imports), then creates the file
FORK_TEST_IMPORTED names, if set.
"""

import argparse
import os
import sys
import time

time.sleep(float(os.environ.get("FORK_TEST_IMPORT_S", "0")))
if os.environ.get("FORK_TEST_IMPORTED"):
    open(os.environ["FORK_TEST_IMPORTED"], "x").close()

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--raise", dest="fail", action="store_true")
    args = parser.parse_args()
    print(
        f"argv={sys.argv[1:]} marker={os.environ.get('FORK_TEST_MARKER')} cuda={os.environ.get('CUDA_VISIBLE_DEVICES')}"
    )
    print(f"name={__name__} sid={os.getsid(0)} pid={os.getpid()}", flush=True)
    if args.fail:
        raise RuntimeError("the child failed on purpose")
    time.sleep(args.sleep)
    sys.exit(args.exit)
