"""scripts/netns_hosts.sh: two test hosts in network namespaces, joined by a shaped link, run one
`ulysses train --check` together through torchrun's rendezvous on host 0's address. Skipped, with
the script's reason, where namespaces cannot be created (no root, or a container without them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "netns_hosts.sh")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _namespaces_or_skip() -> None:
    probe = subprocess.run(["bash", SCRIPT, "--check"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces are not available here: {probe.stderr.strip() or probe.stdout.strip()}")


def _leftover_namespaces(name: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in listed if n.startswith(name)]


def test_two_hosts_on_a_link_train_check_passes():
    _namespaces_or_skip()
    command = (f"exec {TORCHRUN} --nnodes 2 --node_rank $HOST_INDEX --nproc_per_node 1 --master_addr $MASTER_ADDR "
               "--master_port 29611 -m ulysses train --seq-len 63 --pairs 4 --check")
    run = subprocess.run(["bash", SCRIPT, "--hosts", "2", "--rate", "1gbit", "--delay", "200us", "--name", "utst",
                          "--", "sh", "-c", command], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[host 0] PASS" in run.stdout, run.stdout
    assert "on one bridge, egress 1gbit" in run.stdout
    assert _leftover_namespaces("utst") == []


def test_a_failing_host_fails_the_run_and_nothing_is_left_behind():
    _namespaces_or_skip()
    run = subprocess.run(["bash", SCRIPT, "--hosts", "3", "--name", "utsf", "--", "sh", "-c",
                          'test "$HOST_INDEX" != 2 || exit 7; echo "at $HOST_ADDR"'],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 7, run.stdout + run.stderr
    assert "[host 0] at 10.213.0.1" in run.stdout and "[host 1] at 10.213.0.2" in run.stdout
    assert _leftover_namespaces("utsf") == []


def test_bad_options_are_usage_errors():
    for args, message in [(["--hosts", "0"], "--hosts must be 1..200"), (["--name", "Bad!"], "--name must be"),
                          (["--rate", "fast", "--", "true"], "--rate must be an integer"), ([], "no command given")]:
        run = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
