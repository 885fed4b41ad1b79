"""A real one-host Slurm cluster for the tests under tests/slurm (tools/slurm/cluster.sh).

The session-scoped fixture ``slurm_cluster`` starts munge, MariaDB, slurmdbd, slurmctld and four
slurmd (nodes n1..n4; partitions ``debug``, the default, and ``high``, which preempts ``debug``),
exports SLURM_CONF for the whole session and stops every daemon at the end, also when a test or
the start itself fails. Every test in this folder is marked ``slurm``.

It skips only where the Slurm binaries are not installed (``bash tools/slurm/install.sh`` installs
them); under CI (CI=true) a missing install is an error, not a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "tools" / "slurm" / "cluster.sh"
REQUIRED_BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd")
_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


@dataclass(frozen=True)
class SlurmCluster:
    dir: Path
    conf: Path
    nodes: tuple[str, ...]
    partitions: tuple[str, ...]  # the first is the default
    log_dir: Path


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.slurm)


def _missing_binaries() -> list[str]:
    return [b for b in REQUIRED_BINARIES if shutil.which(b, path=_PATH) is None]


def _cluster(cmd: str, directory: Path, timeout: float, **settings: str) -> subprocess.CompletedProcess:
    """cluster.sh CMD DIRECTORY; `settings`: its environment variables (RELAX_SLURM_...)."""
    env = {**os.environ, **settings}
    env.setdefault("USER", "root" if os.geteuid() == 0 else str(os.geteuid()))
    env["PATH"] = _PATH
    return subprocess.run(
        ["bash", str(CLUSTER_SH), cmd, str(directory)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = _missing_binaries()
    if missing:
        reason = f"Slurm not installed (missing {', '.join(missing)}): run `bash tools/slurm/install.sh`"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason} before the tests (CI must run the slurm tests)")
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("tools/slurm/cluster.sh runs the daemons as root")

    directory = tmp_path_factory.mktemp("slurm")
    try:
        started = _cluster("start", directory, timeout=240)
    except subprocess.TimeoutExpired as e:
        _cluster("stop", directory, timeout=120)
        pytest.fail(f"cluster.sh start timed out:\n{e.stdout!r}\n{e.stderr!r}")  # bytes, even with text=True
    if started.returncode != 0:
        _cluster("stop", directory, timeout=120)
        pytest.fail(f"cluster.sh start failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
    conf = directory / "slurm.conf"
    assert started.stdout.strip().splitlines()[-1] == f"export SLURM_CONF={conf}"

    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(conf))
    mp.setenv("PATH", _PATH)
    if "USER" not in os.environ:
        mp.setenv("USER", "root")
    for var in [v for v in os.environ if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if var != "SLURM_CONF":  # a pytest started inside a job must not steer our submissions
            mp.delenv(var)
    try:
        yield SlurmCluster(
            dir=directory,
            conf=conf,
            nodes=("n1", "n2", "n3", "n4"),
            partitions=("debug", "high"),
            log_dir=directory / "log",
        )
    finally:
        mp.undo()
        stopped = _cluster("stop", directory, timeout=180)
        if stopped.returncode != 0:
            print(f"cluster.sh stop failed ({stopped.returncode}):\n{stopped.stdout}\n{stopped.stderr}")


@pytest.fixture(scope="module")
def forgetful_cluster(slurm_cluster, tmp_path_factory):
    """A second cluster, on ports of its own, without accounting (no MariaDB, no slurmdbd: sacct
    answers nothing) whose controller forgets an ended job within seconds (MinJobAge=2, purged
    within about 6 s): what `status` must read right where neither squeue nor sacct knows the job.
    Up in about a second. Yields the environment of its clients (SLURM_CONF)."""
    directory = tmp_path_factory.mktemp("slurm-forgetful")
    settings = {"RELAX_SLURM_ACCOUNTING": "none", "RELAX_SLURM_MIN_JOB_AGE": "2"}
    started = _cluster("start", directory, timeout=120, **settings)
    try:
        assert started.returncode == 0, f"cluster.sh start failed:\n{started.stdout}\n{started.stderr}"
        yield {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
    finally:
        _cluster("stop", directory, timeout=120, **settings)


@pytest.fixture(scope="session")
def image(tmp_path_factory) -> Path:
    """The charliecloud test image (tools/containers/make_test_image.sh): the main environment and,
    at /opt/venv-vllm, vLLM's; built once a session, or waited for where .ci/run builds it."""
    missing = [tool for tool in ("mmdebstrap", "ch-run") if shutil.which(tool) is None]
    if missing:
        reason = f"{', '.join(missing)} not installed (bash tools/containers/install.sh)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    prebuilt = os.environ.get("RELAX_TEST_IMAGE")
    if prebuilt:  # .ci/run builds it beside the checks: a Debian bootstrap, mostly downloads
        return _wait_for_image(Path(prebuilt))
    out = tmp_path_factory.mktemp("image") / "relax_hpc"
    build = subprocess.run(
        ["bash", "tools/containers/make_test_image.sh", str(out)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    return out


def _wait_for_image(image: Path, timeout_s: float = 900) -> Path:
    """The image that .ci/run builds in the background: IMAGE.done or IMAGE.failed ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if image.with_suffix(".done").exists():
            return image
        if image.with_suffix(".failed").exists():
            log = image.with_suffix(".log")
            pytest.fail(f"building {image} failed:\n" + (log.read_text()[-3000:] if log.exists() else ""))
        time.sleep(1)
    pytest.fail(f"{image} was not built within {timeout_s:.0f} s")
