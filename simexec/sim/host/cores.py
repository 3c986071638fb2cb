"""The host's cores as the CPU ranks' threads share them: how the OS runs the threads.

The host model's second half: `simexec.sim.host.model` prices what an instruction costs a core, this
module decides when the instruction gets one.

**How the cores are shared** (`Cores`), a mean-field model of the OS scheduler: each rank's main
thread is one runnable thread while it computes, and none while it waits (gloo blocks without
spinning); communication threads run a short burst per step of a collective. Runnable threads
share the cores the host's other users leave them (`C - background_load`, the cores' worth of CPU
other processes took while the profile's runs were measured) as processor sharing, at most one core
each; a core runs slower while the others are busy too (`compute_contention` when all C are: vCPUs
that are hyperthreads of one physical core, shared caches and memory bandwidth), and slower again
while it alternates between threads (`timeslice_contention` once twice as many are runnable as there
are cores: each switch, and each thread's caches refilled when it comes back). Those two slowdowns
are the main threads': a communication burst runs at its bare share of the cores, since its
CPU-seconds are fitted to the CPU time of collectives that ran on every member at once
(`simexec.calibrate.comm.fit_comm_cpu`), the cores as busy as a collective keeps them, and so hold that
slowdown already. A thread that wakes
(a rank's main thread from a wait, or a communication thread for its next burst) does not run at
once when the running threads already fill the cores: Linux's scheduler (EEVDF) lets a running
thread finish its slice, so the woken one waits until threads ahead of it have run out their
slices, `sched_slice_s x (running + 1 - (C - background_load)) / C`, counting only the running
threads that woke less than a slice ago: one that has run a whole slice since it woke gives its
core to a woken thread that is owed CPU (a ping-pong beside two ranks computing in a loop runs as
fast as beside none, as the micro-benchmarks measure). A thread that goes straight on from one
instruction to the next keeps its core. A thread that wakes onto an idle core waits for that core
instead: on a virtual machine an idle vCPU is halted, and
once it has been idle past the hypervisor's poll window (`idle_poll_s`, KVM's 200 µs) the host
gives its physical core away and must schedule it again, `idle_wake_s` (fitted;
`scripts/probe_host.py idle-wake` measures it). So a member that waits for a late one in a collective wakes slowly,
and a busy host wakes threads faster than an idle one. A rank of a symmetric program stands for
`len(represents[r])` identical ranks: that many threads. A rank's event-loop thread,
`(rank, "loop")`, is at Linux's `SCHED_IDLE` (gloo's TCP loops, as the executor runs them): it gets
the cores the other threads leave, and while they fill them only the fair scheduler's share of its
weight, 3 against their 1024 each. `SlicedCores` (`costs.cpu_scheduler`
"slices") is the other model of the same scheduler: whole slices in turn, ranks drifting out of step.
"""
from __future__ import annotations

import math
from typing import Optional

from simpy.events import Event, Timeout

from simexec.specs.cluster import ClusterSpec


# A SCHED_IDLE thread's scheduling weight against a nice-0 thread's (Linux kernel/sched: WEIGHT_IDLEPRIO 3,
# NICE_0_LOAD 1024): what it gets of a core that runnable threads of normal priority share.
IDLE_WEIGHT = 3.0 / 1024.0


class _Job:
    """A thread's work on the cores. `key` is a rank (its main thread), `(rank, "comm")` (its
    communication thread) or `(rank, "loop")` (its event loop, at idle priority), `k` how many
    identical ranks' threads it stands for."""

    __slots__ = ("done", "first", "left", "k", "key", "comm", "idle")

    def __init__(self, done: Event, left: float, k: int, key):
        self.done, self.first, self.left, self.k, self.key = done, None, left, k, key
        self.comm = isinstance(key, tuple)
        self.idle = self.comm and key[1] == "loop"


class _HostCores:
    """What both models of the host's cores share: the cores, the other users' load, the slowdown of
    busy sibling cores and the wake-up of an idle (halted) vCPU."""

    def __init__(self, env, cores: int, slice_s: float, background: float, contention: float,
                 idle_wake_s: float, idle_poll_s: float, timeslicing: float = 1.0):
        self.env = env
        self.cores = max(1, int(cores))
        self.slice = max(0.0, float(slice_s))
        self.background = max(0.0, float(background))
        self.capacity = free_cores(self.cores, self.background)
        self.contention = max(1.0, float(contention))
        self.timeslicing = max(1.0, float(timeslicing))
        self.idle_wake = max(0.0, float(idle_wake_s))
        self.idle_poll = max(1e-9, float(idle_poll_s))
        self.idle: list[float] = [-math.inf] * self.cores  # when each idle core went idle, the warmest last
        self.last_end: dict = {}  # key -> when its last piece of work ended
        self.cpu_s: dict[int, float] = {}  # rank -> time its threads held a core (main and comm), one copy's
        self.main_cpu_s: dict[int, float] = {}  # rank -> the same for its main thread alone
        self.t = 0.0
        self.ver = 0
        self.active: list = []  # the threads running now, with the work they have left

    def idle_wake_wait(self) -> float:
        """How long waking a thread on the warmest idle core takes: nothing if it went idle just now,
        `idle_wake_s` once it has been idle past the hypervisor's poll window (its vCPU halted and
        descheduled), smoothly in between; nothing while no core is idle."""
        if not self.idle or self.idle_wake <= 0.0:
            return 0.0
        return self.idle_wake * -math.expm1(-(self.env.now - self.idle[-1]) / self.idle_poll)

    def advance(self) -> None:
        """Bring every running thread's remaining work up to now."""
        now = self.env.now
        if self.active and now > self.t:
            dt = now - self.t
            main, comm = self._rates()
            held = dt * min(1.0, self.capacity / max(1, self._running()))  # what the OS counts as CPU time
            low = self._idle_rate()
            for job in self.active:
                if job.idle:
                    job.left -= dt * low
                    self.cpu_s[job.key[0]] = self.cpu_s.get(job.key[0], 0.0) + dt * low
                    continue
                job.left -= dt * (comm if job.comm else main)
                rank = job.key[0] if job.comm else job.key
                self.cpu_s[rank] = self.cpu_s.get(rank, 0.0) + held
                if not job.comm:
                    self.main_cpu_s[rank] = self.main_cpu_s.get(rank, 0.0) + held
        self.t = now

    def _running(self) -> int:
        """How many threads hold the cores now (identical copies counted)."""
        return len(self.active)

    def _tick_in(self, dt: float) -> None:
        """`_tick` after dt, unless the state changes first (a later `_schedule` bumps `ver`)."""
        ver = self.ver
        t = Timeout(self.env, dt)
        t.callbacks.append(lambda _ev: self._tick(ver))

    def rate(self, n: float, runnable: Optional[float] = None) -> float:
        return thread_rate(n, self.cores, self.background, self.contention, self.timeslicing, runnable)

    def _rates(self) -> tuple[float, float]:
        """(a main thread's speed, a communication thread's speed) now. A burst's CPU-seconds were
        measured with the cores as busy as a collective keeps them (`fit_comm_cpu` fits the CPU
        time of collectives run on every rank at once), so the slowdowns of busy and alternating
        cores are in them already: a communication thread gets its share of the cores alone."""
        return self._rate(), self._share()

    def _idle_rate(self) -> float:
        """An idle-priority thread's speed now (`Cores`; `SlicedCores` runs none)."""
        return 0.0

    def _next_end(self) -> float:
        """Seconds until the first running thread finishes its work, at today's speeds."""
        main, comm = self._rates()
        low = self._idle_rate()  # > 0 whenever an idle-priority thread runs
        return min(max(0.0, j.left) / (low if j.idle else comm if j.comm else main) for j in self.active)


def free_cores(cores: float, background: float) -> float:
    """The cores' worth of CPU the ranks' threads share: what the host's other users leave (never
    quite none, so that a host measured fully loaded still runs the ranks)."""
    return max(0.05, cores - background)


def thread_rate(n: float, cores: int, background: float = 0.0, contention: float = 1.0, timeslicing: float = 1.0,
                runnable: Optional[float] = None) -> float:
    """Each of n running threads' speed on `cores` cores of which the host's other users take
    `background`: its share of the cores left, times the slowdown of a core whose siblings are busy
    too (`contention` when all run: hyperthreads, shared caches), times that of a core that
    alternates between threads (`timeslicing` once there are twice as many `runnable` threads,
    running or queued, as cores: each thread in turn switched in and its caches refilled; in
    proportion to the cores that alternate below that)."""
    if n <= 0:
        return 1.0
    capacity = free_cores(cores, background)
    share = min(1.0, capacity / n)
    busy = min(float(cores), n + background)
    if cores > 1 and contention > 1.0:
        share /= 1.0 + (contention - 1.0) * (busy - 1.0) / (cores - 1.0)
    if timeslicing > 1.0:
        alternating = min(1.0, max(0.0, (n if runnable is None else runnable) - capacity) / capacity)
        share /= 1.0 + (timeslicing - 1.0) * alternating
    return share


class Cores(_HostCores):
    """The host's cores as the ranks' threads see them; see the module doc.

    `run(key, seconds)` returns an event that fires once thread `key` (a rank's main thread is its
    rank, its communication thread `(rank, "comm")`) has had `seconds` of CPU; its value is the time
    the work first ran. Threads share the cores the host's other users leave (`cores -
    background`) as processor sharing, at most one core each, and an idle-priority thread (`(rank,
    "loop")`) the cores they leave; a thread that was waiting (not one
    going straight on from its previous piece of work) first waits for a core when the running
    threads that woke less than a slice ago already fill them: `slice x (running + 1 - (cores -
    background)) / cores`. Any thread woken while a core is idle waits for that core to wake
    (`idle_wake_wait`).
    """

    @classmethod
    def of(cls, env, cluster: ClusterSpec, weights: Optional[dict[int, int]] = None):
        """The cores of the cluster's host, as its cost parameters describe them: `SlicedCores` under
        `costs.cpu_scheduler` "slices" (unless a rank stands for several: identical copies are shared
        mean-field), else processor sharing."""
        c = cluster.costs
        if c.cpu_scheduler == "slices" and not any(k > 1 for k in (weights or {}).values()):
            return SlicedCores(env, cluster.node.cpu_cores, c.sched_slice_s, c.background_load,
                               c.compute_contention, c.idle_wake_s, c.idle_poll_s, c.timeslice_contention)
        return cls(env, cluster.node.cpu_cores, c.sched_slice_s, c.background_load, weights or {},
                   c.compute_contention, c.idle_wake_s, c.idle_poll_s, c.timeslice_contention)

    def __init__(self, env, cores: int, slice_s: float, background: float, weights: dict[int, int],
                 contention: float = 1.0, idle_wake_s: float = 0.0, idle_poll_s: float = 200e-6,
                 timeslicing: float = 1.0):
        super().__init__(env, cores, slice_s, background, contention, idle_wake_s, idle_poll_s, timeslicing)
        self.weights = weights
        self.n = 0  # threads running (copies counted), but those at idle priority
        self.n_idle = 0  # idle-priority threads running (copies counted)
        self.awake: dict = {}  # key -> when its thread last woke (its slice runs from then)

    def weight_of(self, key) -> int:
        """How many threads a key's job counts for: its rank's weight (the ranks it stands for)."""
        rank = key[0] if isinstance(key, tuple) else key
        return self.weights.get(rank, 1)

    def wake_wait(self) -> float:
        """How long a thread that wakes now waits for a core: nothing while the ranks' running threads
        leave a core free or one of them has run a whole slice since it woke (EEVDF gives the core of
        a thread past its slice to a woken one); else, per thread too many, a share of a slice (the
        threads ahead of it run out their slices on the C cores first)."""
        now = self.env.now
        within = sum(j.k for j in self.active if not j.idle and now - self.awake.get(j.key, -math.inf) < self.slice)
        over = within + 1 - self.capacity
        over = over + math.log1p(math.exp(-4.0 * abs(over))) / 4.0 if over > 0 else math.log1p(math.exp(4.0 * over)) / 4.0
        return self.slice * over / self.cores  # a smooth max(0, over): the fits need a smooth model

    def run(self, key, seconds: float) -> Event:
        done = Event(self.env)
        if seconds <= 0.0:
            done.succeed(self.env.now)
            return done
        going_on = self.last_end.get(key) == self.env.now
        job = _Job(done, seconds, self.weight_of(key), key)
        # an idle-priority thread preempts nobody: it runs on what is left (`_idle_rate`)
        wait = 0.0 if going_on else self.idle_wake_wait() + (0.0 if job.idle else self.wake_wait())
        if not going_on:
            self.awake[key] = self.env.now + wait
        if wait > 0.0:
            t = Timeout(self.env, wait)
            t.callbacks.append(lambda _ev, job=job: self._add(job))
        else:
            self._add(job)
        return done

    def _rate(self) -> float:
        return self.rate(self.n)

    def _running(self) -> int:
        return self.n

    def _share(self) -> float:
        return thread_rate(self.n, self.cores, self.background)

    def _idle_rate(self) -> float:
        """The cores the other threads leave, shared by the idle-priority threads, at most one each;
        while the others fill the cores, the fair scheduler's share of a `SCHED_IDLE` weight."""
        if self.n_idle <= 0:
            return 0.0
        left = (self.capacity - self.n) / self.n_idle
        fair = self.capacity * IDLE_WEIGHT / (self.n + IDLE_WEIGHT * self.n_idle)
        return min(1.0, max(left, fair))

    def _add(self, job: _Job) -> None:
        self.advance()
        job.first = self.env.now
        self.active.append(job)
        if job.idle:
            self.n_idle += job.k
        else:
            self.n += job.k
        del self.idle[max(0, len(self.idle) - job.k):]  # it takes the warmest idle cores
        self._schedule()

    def _schedule(self) -> None:
        self.ver += 1
        if not self.active:
            return
        self._tick_in(self._next_end())

    def _tick(self, ver: int) -> None:
        if ver != self.ver:
            return
        self.advance()
        left = []
        now = self.env.now
        for job in self.active:
            if job.left <= 1e-12:
                if job.idle:
                    self.n_idle -= job.k
                else:
                    self.n -= job.k
                self.idle += [now] * (max(0, self.cores - self.n - self.n_idle) - len(self.idle))
                self.last_end[job.key] = now
                job.done.succeed(job.first)
            else:
                left.append(job)
        self.active = left
        self._schedule()


class _Thread:
    """A thread of `SlicedCores`; an event loop's (`(rank, "loop")`) runs as a communication thread."""

    __slots__ = ("done", "first", "left", "key", "comm", "idle", "since")

    def __init__(self, done: Event, left: float, key):
        self.done, self.first, self.left, self.key = done, None, left, key
        self.comm = isinstance(key, tuple)
        self.idle = False
        self.since = 0.0  # when it last got its core (its slice runs from then)


_HANDOFF_S = 1e-9  # how long a finished thread keeps its core for its next instruction (same instant)


class SlicedCores(_HostCores):
    """The host's cores as an OS scheduler runs them: whole slices, in turn.

    Same interface as `Cores` (`run(key, seconds)`), another model of the same scheduler. Each of
    the C cores runs one thread at a time, at full speed but for `compute_contention` while the
    other cores are busy too (and the share the host's other users leave, `background_load`). A
    main thread that wakes takes an idle core (after `idle_wake_wait`, as in `Cores`) or queues;
    one going straight on to its next instruction keeps its core. A main thread that has run a
    slice (`sched_slice_s`) while others queue goes to the back of the queue. A communication
    thread that wakes beside busy cores preempts a main thread that has run a whole slice on its
    core (Linux's EEVDF gives a woken thread that is owed CPU the core of a thread past its slice),
    which resumes first once the burst is over; else it queues ahead of the main threads, for the
    first core whose slice ends. So ranks that share cores drift out of step: some compute
    at full speed while others wait, and one communicates while another computes, where processor
    sharing runs them all in lockstep at a fraction of the speed.
    """

    def __init__(self, env, cores: int, slice_s: float, background: float, contention: float = 1.0,
                 idle_wake_s: float = 0.0, idle_poll_s: float = 200e-6, timeslicing: float = 1.0):
        super().__init__(env, cores, max(50e-6, float(slice_s)), background, contention, idle_wake_s, idle_poll_s,
                         timeslicing)
        self.free = self.cores  # cores nobody holds (not running, not waking, not kept for a hand-off)
        self.active: list[_Thread] = []
        self.main_q: list[_Thread] = []
        self.comm_q: list[_Thread] = []
        self.kept: dict = {}  # key -> (slice start, token): a finished main thread's core, until its next run
        self._token = 0

    def run(self, key, seconds: float) -> Event:
        done = Event(self.env)
        if seconds <= 0.0:
            done.succeed(self.env.now)
            return done
        th = _Thread(done, seconds, key)
        if not th.comm and key in self.kept:
            since, _ = self.kept.pop(key)
            self._start(th, since)
        elif self.free > 0:
            wait = 0.0 if self.last_end.get(key) == self.env.now else self.idle_wake_wait()
            self.free -= 1
            self.idle.pop()
            if wait > 0.0:
                t = Timeout(self.env, wait)
                t.callbacks.append(lambda _ev, th=th: self._start(th, self.env.now))
            else:
                self._start(th, self.env.now)
        elif th.comm and any(not r.comm and self.env.now - r.since >= self.slice for r in self.active):
            victim = min((r for r in self.active if not r.comm), key=lambda r: r.since)
            self.advance()
            self.active.remove(victim)
            self.main_q.insert(0, victim)
            self._start(th, self.env.now)
        else:
            self.advance()
            (self.comm_q if th.comm else self.main_q).append(th)
            self._schedule()  # the running threads' slices now end
        return done

    def _rate(self) -> float:
        return self.rate(len(self.active), len(self.active) + len(self.main_q) + len(self.comm_q))

    def _share(self) -> float:
        return thread_rate(len(self.active), self.cores, self.background)

    def _start(self, th: _Thread, since: float) -> None:
        if not th.comm and self.comm_q:  # a burst queued while this core was waking: it goes first
            self.main_q.insert(0, th)
            th, since = self.comm_q.pop(0), self.env.now
        self.advance()
        if th.first is None:
            th.first = self.env.now
        th.since = since
        self.active.append(th)
        self._schedule()

    def _release(self) -> None:
        """A core is given up: the next waiting thread takes it (it is warm), or it goes idle."""
        q = self.comm_q or self.main_q
        if q:
            self._start(q.pop(0), self.env.now)
        else:
            self.free += 1
            self.idle.append(self.env.now)

    def _handoff(self, key, token: int) -> None:
        kept = self.kept.get(key)
        if kept is not None and kept[1] == token:
            del self.kept[key]
            self.advance()
            self._release()
            self._schedule()

    def _schedule(self) -> None:
        self.ver += 1
        if not self.active:
            return
        dt = self._next_end()
        if self.main_q or self.comm_q:
            now = self.env.now
            for th in self.active:
                if not th.comm:
                    dt = min(dt, max(0.0, th.since + self.slice - now))
        self._tick_in(dt)

    def _tick(self, ver: int) -> None:
        if ver != self.ver:
            return
        self.advance()
        now = self.env.now
        finished = [th for th in self.active if th.left <= 1e-12]
        for th in finished:
            self.active.remove(th)
            self.last_end[th.key] = now
            th.done.succeed(th.first)
            if not th.comm and (self.main_q or self.comm_q):
                self._token += 1
                self.kept[th.key] = (th.since, self._token)
                t = Timeout(self.env, _HANDOFF_S)
                t.callbacks.append(lambda _ev, key=th.key, tok=self._token: self._handoff(key, tok))
            else:
                self._release()
        if self.main_q or self.comm_q:
            for th in [th for th in self.active if not th.comm and th.since + self.slice <= now + 1e-12]:
                if not (self.main_q or self.comm_q):
                    break
                self.active.remove(th)
                self.main_q.append(th)
                self._release()
        self._schedule()
