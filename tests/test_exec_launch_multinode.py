"""Runs that need a Ray of their own, in a subprocess (a process joins one Ray at a time):
a two-node local Ray cluster, and Ctrl-C of a driver that started Ray itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simexec.exec.runtime.launcher import live_workers

REPO = Path(__file__).resolve().parents[1]
# the child imports the project and these tests from this checkout
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]
                                                          + [p for p in [os.environ.get("PYTHONPATH")] if p])}
PRELUDE = """
import os, sys, json, functools
import test_exec_launch as T
from simexec.exec.api import execute
"""

TWO_NODES = PRELUDE + """
import ray
import test_exec_launch_multinode as TN
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                         "include_dashboard": False})
cluster.add_node(num_cpus=2, resources={"node_b": 1})
cluster.wait_for_nodes()
try:
    pids = T.Pids()
    res = execute("gpt-tiny", "local", "dp=2,tp=2", steps=2, runner=T.stand_in, ray_address=cluster.address,
                  on_start=pids)
    ray.init(address=cluster.address)
    names = {n["NodeID"]: ("a" if "node_a" in n["Resources"] else "b") for n in ray.nodes()}
    print("RESULT", json.dumps({"losses": res.losses, "events": len(res.trace.events),
                                "placement": {r: names[n] for r, n in res.placement.items()},
                                "timings": res.timings, "pids": pids.pids,
                                "daemons": TN.ray_daemons_under(os.getpid())}), flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
"""

# A terminal starts a program with Ctrl-C deliverable. A child of this test process inherits its
# signal mask and ignored signals instead, and the Ray driver threads of earlier tests in this
# process can leave SIGINT blocked there; so the child first takes the terminal's state.
TERMINAL_SIGINT = """
import signal
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
"""

INTERRUPTED = TERMINAL_SIGINT + PRELUDE + """
def started(infos):
    print("STARTED", json.dumps([i["pid"] for i in infos]), flush=True)
try:
    execute("gpt-tiny", "local", "dp=2", steps=10**6, runner=functools.partial(T.stand_in, delay=0.005),
            on_start=started)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    sys.exit(130)
"""


def ray_daemons_under(root: int) -> list[int]:
    """Pids of Ray's daemons (raylet, GCS) started by process `root` or its descendants; other Ray
    sessions on this host are not ours to count."""
    parent, names = {}, {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as fh:
                parent[int(p)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                names[int(p)] = fh.read()
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [c for c, pp in parent.items() if pp == pid]
        todo.extend(kids)
        out.extend(c for c in kids if b"raylet" in names.get(c, b"") or b"gcs_server" in names.get(c, b""))
    return out


def alive(pids) -> list[int]:
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(p)
        except OSError:
            pass
    return out


@pytest.mark.ray
def test_two_ray_nodes_keep_tp_groups_together():
    out = subprocess.run([sys.executable, "-c", TWO_NODES], cwd=REPO, env=CHILD_ENV, capture_output=True, text=True,
                         timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    res = json.loads(line[len("RESULT "):])
    place = {int(r): n for r, n in res["placement"].items()}
    assert place[0] == place[1] and place[2] == place[3]  # each TP group on one node
    assert place[0] != place[2]  # 2 CPUs per node: the two TP groups must use both nodes
    assert res["losses"] == [1.0, 2.0] and res["events"] > 0
    assert len(res["daemons"]) >= 3  # GCS and two raylets
    assert live_workers(res["pids"]) == [] and alive(res["daemons"]) == []


@pytest.mark.ray
def test_ctrl_c_tears_everything_down():
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED], cwd=REPO, env=CHILD_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        pids = None
        for line in proc.stdout:
            if line.startswith("STARTED "):
                pids = json.loads(line[len("STARTED "):])
                break
            assert time.monotonic() < deadline
        assert pids, "the run never started"
        daemons = ray_daemons_under(proc.pid)
        assert daemons, "the driver should have started Ray itself"
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "INTERRUPTED" in rest and proc.returncode == 130, rest[-3000:]
    assert took < 30
    assert live_workers(pids) == [] and alive(daemons) == []
