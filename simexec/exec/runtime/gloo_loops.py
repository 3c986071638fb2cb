"""Keep gloo's TCP event-loop threads from holding the cores while they spin.

gloo's TCP transport reads and writes its sockets on one event-loop thread per device
(`gloo_tcp_loop`), polling with level-triggered epoll. When the loop cannot consume a ready socket
(it cannot take the pair's lock at once, `Pair::handleEvents`' `try_to_lock`, or the buffer the
bytes are for is not registered yet) it returns to epoll, which reports the socket again: it spins.
With spare cores that costs nothing. With CPU ranks sharing a few cores, `perf` shows both ranks'
loops spinning on the two cores while the collectives' worker threads sleep, until the scheduler's
next tick (4 ms at HZ=250): a 1 MB two-rank all-reduce issued right after 20 ms of compute took a
median 3.8 ms, 95% of samples over 2 ms, on a 2-core VM (`python scripts/probe_host.py collective-series
--compute-ms 20 --gloo-loops default`). With the loop threads at `SCHED_IDLE`, which any other
runnable thread preempts, the same all-reduce took 1.8 ms, 18% over 2 ms (`--gloo-loops idle`;
docs/host_model.md, "gloo's event loops at idle priority"). The loop still runs whenever a core has nothing
else to do. `SIMEXEC_GLOO_LOOPS=default` in the environment of the ranks leaves the loops as gloo
starts them (to measure the difference).
"""
from __future__ import annotations

import os

LOOP_THREAD = "gloo_tcp_loop"
POLICY_ENV = "SIMEXEC_GLOO_LOOPS"  # "default": leave the loops alone


def loop_threads() -> list[int]:
    """The thread ids of this process's gloo event loops (none where /proc is absent)."""
    if not os.path.isdir("/proc/self/task"):
        return []
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == LOOP_THREAD:
                    tids.append(int(tid))
        except OSError:  # the thread has ended
            continue
    return tids


def idle_gloo_loops() -> int:
    """Put this process's gloo event-loop threads at `SCHED_IDLE`; returns how many are at it now.

    Linux only (elsewhere, or where the policy cannot be set, it changes nothing and returns 0).
    Call it after the process groups exist: each group's device starts its own loop thread."""
    if os.environ.get(POLICY_ENV) == "default" or not hasattr(os, "SCHED_IDLE"):
        return 0
    idled = 0
    for tid in loop_threads():
        try:
            if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            idled += 1
        except OSError:  # the thread ended, or the policy is not permitted here
            continue
    return idled
