"""The discrete-event interpreter of a Program: one SimPy process per (rank, stream).

A stream runs its instructions in order; each waits for its `deps` (same rank, other streams).
Collectives start when every present member of the group has issued them (matched by name and
group). A communication stream (`comm.<axis>`, one process group) holds up to
`costs.collective_threads` collectives in flight: NCCL runs a communicator's one after another on
one CUDA stream, gloo hands a group's async collectives to two worker threads, so one started
behind a slow one can finish first. A send and its recv are a rendezvous: the message moves once
both are posted, a recv being posted when its rank's thread gets past the compute before it in
program order; neither blocks its stream (isend / irecv), and whoever needs the data waits on the
recv's end. Memory instructions take no time. Every instruction's start and end are recorded in two flat arrays.

What an instruction costs is not decided here: a machine (`MachineModel`, implemented by
`simexec.sim.machine`) prices compute, runs transfers, and may hand out the cores that compute runs on
(CPU ranks sharing a host) or issue each instruction from an eager host thread. One thing is the
engine's: `compute_slowdown` (simulated rank -> factor >= 1) stretches every compute instruction of a
rank by its factor after the machine has priced it: a straggler, or a GPU slower than its peers
(`simexec.sim.slowdown` makes the factors, a representative taking the slowest it stands for).

Speed, without approximation:
- a chain of compute instructions that nothing on another stream waits on, and whose own
  cross-stream deps have already finished, runs as one timeout; each instruction's times follow by
  arithmetic. Compute slows while transfers of the same rank are in flight, by the SMs they hold
  (the machine's `transfer_sms` and `compute_rate`): the running chain is re-rated in place (its
  timeout swapped) whenever that changes, so the times stay exact;
- memory instructions that wait on nothing are not visited: they happen when their stream
  predecessor ends;
- an instruction's completion wakes the processes waiting on it at once, at the same simulated
  time, instead of through one more scheduled event.
Swapping a timeout and waking at once touch SimPy 4's event internals (`Event.callbacks`, `_ok`, `_value`,
`Process._resume`, `_target`); they are confined to `_fire` and `Engine._rerate`.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import simpy
from simpy.events import Event, Timeout

from simexec.program.instructions import Instr, Program, ProgramError

COMPUTE, COLLECTIVE, SEND, RECV, COPY, MEMORY, HOST = range(7)
_KIND = {"compute": COMPUTE, "collective": COLLECTIVE, "send": SEND, "recv": RECV, "copy": COPY, "memory": MEMORY}


def _fire(ev: Event) -> None:
    """Trigger `ev` and run its callbacks now (what `succeed()` does one scheduler step later)."""
    ev._ok, ev._value = True, None
    callbacks, ev.callbacks = ev.callbacks, None
    for cb in callbacks:
        cb(ev)


class _Run:
    """A chain of compute instructions running as one timeout on one rank."""

    __slots__ = ("proc", "timer", "t", "rate", "left", "marks")


class _Match:
    """One collective instance or one send/recv pair: who has arrived, and when the data is there."""

    __slots__ = ("arrived", "needed", "done", "xfer_start")

    def __init__(self, needed: int):
        self.arrived = 0
        self.needed = needed
        self.done: Optional[Event] = None
        self.xfer_start = -1.0


class _Flight:
    """The collectives a concurrent stream has in flight; `freed()` fires when one of them ends."""

    __slots__ = ("env", "n", "slot")

    def __init__(self, env):
        self.env, self.n, self.slot = env, 0, None

    def add(self, done: Event, finished) -> None:
        self.n += 1

        def ended(_ev):
            finished()
            self.n -= 1
            slot, self.slot = self.slot, None
            if slot is not None:
                _fire(slot)

        done.callbacks.append(ended)

    def freed(self) -> Event:
        self.slot = Event(self.env)
        return self.slot


class Cores(Protocol):
    """Cores that the ranks' threads share: `run` is an event that fires, its value the time the
    thread got a core, once `seconds` of CPU have run on them."""

    def run(self, rank: int, seconds: float) -> Event: ...


class MachineModel(Protocol):
    """What the engine asks of the hardware (`simexec.sim.machine`).

    Prices: `work` (a compute instruction at full speed), `host_work` (a CPU optimizer step), then
    `reprice` once the whole program is known, in place. Compute runs on the rank's device at
    `compute_rate(held)` while the rank's transfers in flight hold `held` SMs in all (each
    `transfer_sms`), unless the machine hands out `cores`
    (set by `bind`): then every compute, copy and host step waits for a core. `issue_clock` is an
    eager host's seconds to issue each instruction and whether it waits for the device first.
    Transfers: `start_*` run one and call `finish()` when it is over."""

    cluster: object
    cores: Optional[Cores]

    def bind(self, env) -> object: ...
    def work(self, ins: Instr) -> float: ...
    def host_work(self, ins: Instr) -> float: ...
    def reprice(self, instrs: list[Instr], work: list[float]) -> None: ...
    def issue_clock(self) -> Optional[tuple[list[float], list[bool]]]: ...
    def transfer_sms(self, ins: Instr) -> int: ...
    def compute_rate(self, held: int) -> float: ...
    def comm_ranks(self, ins: Instr) -> tuple[int, ...]: ...
    def p2p_ranks(self, ins: Instr) -> tuple[int, ...]: ...
    def start_collective(self, ins: Instr, ranks: tuple[int, ...], finish: Callable[[], None]) -> None: ...
    def start_p2p(self, ins: Instr, src: int, dst: int, ranks: tuple[int, ...], finish: Callable[[], None]) -> None: ...
    def start_copy(self, ins: Instr, finish: Callable[[], None]) -> None: ...
    def start_cpu_step(self, ins: Instr, params: float, finish: Callable[[], None]) -> None: ...


class Engine:
    """Run one program against one machine; `run()` returns the step time."""

    def __init__(self, program: Program, machine: MachineModel,
                 compute_slowdown: Optional[dict[int, float]] = None):
        self.program = program
        self.machine = machine
        self.env = simpy.Environment()
        self._load(program)
        machine.reprice(self.instrs, self.work)
        if compute_slowdown:
            self._slow_down(compute_slowdown)
        clock = machine.issue_clock()
        self.issue, self.host_sync = clock if clock is not None else (None, None)
        self.host_clock = dict.fromkeys(program.ranks, 0.0)

    # --- preparation -----------------------------------------------------------------------------

    def _load(self, program: Program) -> None:
        """Flatten the program: global index per instruction, cross-stream deps, matches, costs."""
        m = self.machine
        slots = self.slots = m.cluster.costs.collective_threads
        instrs: list[Instr] = []
        for rank in sorted(program.ranks):
            instrs.extend(program.ranks[rank])
        n = len(instrs)
        # Defaults cover most instructions; only the exceptions are written below.
        kind = [COMPUTE] * n
        xdeps: list[tuple[int, ...]] = [()] * n
        match = [-1] * n
        work = [0.0] * n
        streams: dict[tuple[int, str], list[int]] = {}
        matches: list[_Match] = []
        coll_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        p2p_ids: dict[tuple[str, int, int], int] = {}
        present = set(program.ranks)
        needed_of: dict[tuple[int, ...], int] = {}
        memory: list[int] = []  # memory instructions, in program order
        anchor_of: dict[int, int] = {}  # memory instr not visited -> the instruction it ends with (-1: none)
        signals: set[int] = set()
        cost_cache: dict[tuple, float] = {}
        work_of, host_work = m.work, m.host_work
        kinds = _KIND
        base = 0
        for rank in sorted(program.ranks):
            rank_instrs = program.ranks[rank]
            local: dict[str, int] = {}
            seqs: dict[str, list[int]] = {}
            last_compute = -1  # a receive is posted when the rank's thread gets to it: after this
            for k, ins in enumerate(rank_instrs, base):
                local[ins.name] = k
                st = ins.stream
                seq = seqs.get(st)
                if seq is None:
                    seq = seqs[st] = streams[(rank, st)] = []
                concurrent = slots > 1 and st.startswith("comm.")
                deps = ins.deps
                last_coll = -1  # (concurrent stream) the last collective of this stream it waits on
                if deps:
                    out = None
                    for dname in deps:
                        d = local.get(dname)
                        if d is None:
                            raise ProgramError(
                                f"rank {rank}: {ins.name} waits on {dname}, which does not come before it")
                        if d in anchor_of:  # an unvisited memory instruction ends with its predecessor
                            d = anchor_of[d]
                            if d < 0:
                                continue
                        same_coll = concurrent and instrs[d].stream == st and instrs[d].kind == "collective"
                        if same_coll:
                            last_coll = max(last_coll, d)
                        if instrs[d].stream != st or same_coll:
                            if out is None:
                                out = [d]
                            else:
                                out.append(d)
                            signals.add(d)
                    if out is not None:
                        xdeps[k] = tuple(out)
                kd = kinds.get(ins.kind, -1)
                if kd == COMPUTE:
                    last_compute = k
                    if ins.op == "cpu_optimizer" or st == "host":
                        kind[k] = HOST
                        work[k] = host_work(ins)
                    else:
                        key = (ins.op, ins.flops, ins.bytes, ins.phase, ins.keys, ins.gemm_groups, ins.host_s)
                        w = cost_cache.get(key)
                        if w is None:
                            w = cost_cache[key] = work_of(ins)
                        work[k] = w
                    seq.append(k)
                    continue
                kind[k] = kd
                if kd == MEMORY:
                    memory.append(k)
                    if last_coll >= 0:  # it happens when that collective ends, holding no thread
                        anchor_of[k] = last_coll
                    elif xdeps[k] or concurrent:  # (on a concurrent stream its predecessor may still run)
                        seq.append(k)
                    else:
                        anchor_of[k] = seq[-1] if seq else -1
                    continue
                if kd == COLLECTIVE:
                    need = needed_of.get(ins.group)
                    if need is None:
                        need = needed_of[ins.group] = sum(1 for r in ins.group if r in present)
                    if need > 1:  # else (symmetric mode) this rank alone issues it: nothing to match
                        ckey = (ins.name, ins.group)
                        mid = coll_ids.get(ckey)
                        if mid is None:
                            mid = coll_ids[ckey] = len(matches)
                            matches.append(_Match(need))
                        match[k] = mid
                elif kd == SEND or kd == RECV:
                    if kd == RECV and last_compute >= 0 and last_compute not in xdeps[k]:
                        xdeps[k] = xdeps[k] + (last_compute,)
                        signals.add(last_compute)
                    pkey = (ins.name, rank, ins.peer) if kd == SEND else (ins.name, ins.peer, rank)
                    mid = p2p_ids.get(pkey)
                    if mid is None:
                        mid = p2p_ids[pkey] = len(matches)
                        matches.append(_Match(2 if ins.peer in present else 1))
                    match[k] = mid
                elif kd < 0:
                    raise ProgramError(f"{ins.id}: unknown instruction kind {ins.kind!r}")
                seq.append(k)
            base += len(rank_instrs)
        self.instrs, self.kind, self.xdeps, self.match, self.work = instrs, kind, xdeps, match, work
        self.streams, self.matches, self.anchor_of, self.memory = streams, matches, anchor_of, memory
        self.signals = [False] * n
        for d in signals:
            self.signals[d] = True
        self.start = [-1.0] * n
        self.end = [-1.0] * n
        self._waiters: dict[int, Event] = {}
        self._runs: dict[int, list[_Run]] = {r: [] for r in program.ranks}
        self._inflight: dict[int, int] = dict.fromkeys(program.ranks, 0)

    def _slow_down(self, factors: dict[int, float]) -> None:
        """A slowed rank's compute (device kernels and host optimizer steps) takes `factor` x longer."""
        work, kind, instrs = self.work, self.kind, self.instrs
        for k, ins in enumerate(instrs):
            f = factors.get(ins.rank, 1.0)
            if f != 1.0 and (kind[k] == COMPUTE or kind[k] == HOST):
                work[k] *= f

    # --- running ---------------------------------------------------------------------------------

    def run(self) -> float:
        """Simulate; return the time the last instruction ends."""
        env = self.env
        self.machine.bind(env)
        self.cores = self.machine.cores
        for (rank, _), seq in sorted(self.streams.items()):
            if seq:
                holder: list = []
                holder.append(env.process(self._stream(rank, seq, holder)))
        env.run()
        self._check_finished()
        end = self.end
        for k, pred in self.anchor_of.items():
            self.start[k] = end[k] = end[pred] if pred >= 0 else 0.0
        return max(end, default=0.0)

    def _check_finished(self) -> None:
        stuck = []
        for (rank, stream), seq in sorted(self.streams.items()):
            if not seq or self.end[seq[-1]] >= 0.0:  # a stream that ran its last instruction ran them all
                continue
            for k in seq:
                if self.end[k] < 0:
                    ins = self.instrs[k]
                    waits = [self.instrs[d].name for d in self.xdeps[k] if self.end[d] < 0]
                    why = f"waits on {', '.join(waits)}" if waits else (
                        "waits for its group / peer" if self.kind[k] in (COLLECTIVE, RECV, SEND) else "blocked")
                    stuck.append(f"{ins.id} on {stream} ({why})")
                    break
        if stuck:
            more = f" (and {len(stuck) - 8} more streams)" if len(stuck) > 8 else ""
            raise ProgramError("program deadlocks: " + "; ".join(stuck[:8]) + more)

    def _finished(self, k: int) -> None:
        self.end[k] = self.env.now
        ev = self._waiters.pop(k, None)
        if ev is not None:
            _fire(ev)

    def _stream(self, rank: int, seq: list[int], holder: list):
        env, kind, xdeps, end, start = self.env, self.kind, self.xdeps, self.end, self.start
        signals, waiters, matches, match = self.signals, self._waiters, self.matches, self.match
        machine, instrs, work, inflight = self.machine, self.instrs, self.work, self._inflight
        runs = self._runs[rank]
        rate_of = self.machine.compute_rate
        cores = self.cores
        proc = holder[0]
        slots = self.slots if self.instrs[seq[0]].stream.startswith("comm.") else 1
        flight = _Flight(env) if slots > 1 else None
        i, n = 0, len(seq)
        while i < n:
            k = seq[i]
            for d in xdeps[k]:
                if end[d] < 0.0:
                    ev = waiters.get(d)
                    if ev is None:
                        ev = waiters[d] = Event(env)
                    yield ev
            kd = kind[k]
            if cores is not None and (kd == COMPUTE or kd == HOST or kd == COPY):  # a thread on the shared cores
                ev = cores.run(rank, work[k])
                yield ev
                start[k] = ev.value
                end[k] = env.now
                if signals[k]:
                    self._finished(k)
                i += 1
                continue
            if kd == COMPUTE:
                issue = self.issue
                if issue is not None and issue[k] > 0.0:  # the host issues it (the machine's issue_clock)
                    h = self.host_clock[rank]
                    if self.host_sync[k] and h < env.now:
                        h = env.now  # the host waited for the device to get here
                    if env.now < h:
                        yield Timeout(env, h - env.now)
                    h += issue[k]
                    self.host_clock[rank] = h
                # A chain: following compute instructions that nobody else waits on and whose
                # cross-stream deps are done already run in the same timeout.
                total = work[k]
                j = i + 1
                if not signals[k] and issue is None:
                    while j < n:
                        k2 = seq[j]
                        if kind[k2] != COMPUTE:
                            break
                        ready = True
                        for d in xdeps[k2]:
                            if end[d] < 0.0:
                                ready = False
                                break
                        if not ready:
                            break
                        total += work[k2]
                        j += 1
                        if signals[k2]:
                            break
                run = _Run()
                run.proc = proc
                run.t = t0 = env.now
                run.rate = rate0 = rate_of(inflight[rank]) if inflight[rank] else 1.0
                run.left = total
                run.marks = None
                run.timer = Timeout(env, total / rate0)
                runs.append(run)
                yield run.timer
                runs.remove(run)
                if run.marks is None:
                    t = t0
                    for x in range(i, j):
                        k = seq[x]
                        start[k] = t
                        t += work[k] / rate0
                        end[k] = t
                else:
                    self._place(run, seq, i, j, t0, rate0)
                k = seq[j - 1]
                if issue is not None and env.now < self.host_clock[rank]:  # its last operator is not issued yet
                    yield Timeout(env, self.host_clock[rank] - env.now)
                end[k] = env.now
                if signals[k]:
                    self._finished(k)
                i = j
                continue
            now = env.now
            start[k] = now
            if kd == MEMORY:
                self._finished(k)
                i += 1
                continue
            ins = instrs[k]
            if kd == COLLECTIVE:
                if self.host_sync is not None and self.host_sync[k] and self.host_clock[rank] < now:
                    self.host_clock[rank] = now  # the host waited for the device to get here (token counts)
                mid = match[k]
                if mid < 0:  # the only present member
                    done = Event(env)
                    ranks = (rank,)
                    held = machine.transfer_sms(ins)
                    self._comm_begin(ranks, held)
                    machine.start_collective(ins, ranks, self._finisher(ranks, done, held))
                else:
                    mt = matches[mid]
                    done = mt.done
                    if done is None:
                        done = mt.done = Event(env)
                    mt.arrived += 1
                    if mt.arrived == mt.needed:
                        mt.xfer_start = now
                        ranks = machine.comm_ranks(ins)
                        held = machine.transfer_sms(ins)
                        self._comm_begin(ranks, held)
                        machine.start_collective(ins, ranks, self._finisher(ranks, done, held))
                if flight is not None:  # the next one may start while this one runs
                    flight.add(done, lambda k=k: self._finished(k))
                    if flight.n >= slots:
                        yield flight.freed()
                    i += 1
                    continue
            elif kd == SEND or kd == RECV:
                # A message moves once both ends have posted it (NCCL's send/recv and gloo's pairs
                # are rendezvous), and neither end's stream waits for it: later messages are posted
                # at once, as `isend` / `irecv` are; whoever needs the data waits on its end.
                mt = matches[match[k]]
                done = mt.done
                if done is None:
                    done = mt.done = Event(env)
                done.callbacks.append(lambda _ev, k=k: self._finished(k))
                mt.arrived += 1
                if mt.arrived == mt.needed:
                    mt.xfer_start = now
                    src, dst = (ins.rank, ins.peer) if kd == SEND else (ins.peer, rank)
                    ranks = machine.p2p_ranks(ins) if mt.needed == 2 else (rank,)
                    held = machine.transfer_sms(ins)
                    self._comm_begin(ranks, held)
                    machine.start_p2p(ins, src, dst, ranks, self._finisher(ranks, done, held))
                i += 1
                continue
            elif kd == COPY:
                done = Event(env)
                ranks = (rank,)
                held = machine.transfer_sms(ins)
                self._comm_begin(ranks, held)
                machine.start_copy(ins, self._finisher(ranks, done, held))
            else:  # HOST
                done = Event(env)
                machine.start_cpu_step(ins, work[k], self._finisher((), done, 0))
            yield done
            self._finished(k)
            i += 1
        while flight is not None and flight.n:
            yield flight.freed()

    # --- compute chains --------------------------------------------------------------------------

    def _place(self, run: _Run, seq: list[int], i: int, j: int, t0: float, rate0: float) -> None:
        """Times of a chain whose rate changed while it ran: walk the (time, rate) breakpoints."""
        marks = [(t0, rate0, 0.0)] + run.marks  # (time, rate from then on, work done by then)
        start, end, work = self.start, self.end, self.work
        seg = 0

        def at(w: float) -> float:
            nonlocal seg
            while seg + 1 < len(marks) and marks[seg + 1][2] <= w:
                seg += 1
            t, r, w0 = marks[seg]
            return t + (w - w0) / r

        done = 0.0
        for x in range(i, j):
            k = seq[x]
            start[k] = at(done)
            done += work[k]
            end[k] = at(done)

    def _rerate(self, rank: int) -> None:
        """The SMs the rank's transfers in flight hold changed: chains running there continue at the new rate."""
        env = self.env
        now = env.now
        held = self._inflight[rank]
        rate = self.machine.compute_rate(held) if held else 1.0
        for run in self._runs[rank]:
            if run.rate == rate:
                continue
            moved = (now - run.t) * run.rate
            run.left -= moved
            if run.left < 0.0:
                run.left = 0.0
            if run.marks is None:
                run.marks = []
            done = (run.marks[-1][2] if run.marks else 0.0) + moved
            run.marks.append((now, rate, done))
            run.t = now
            run.rate = rate
            # Swap the timeout the process waits on for one at the new finishing time.
            resume = run.proc._resume
            run.timer.callbacks.remove(resume)
            run.timer = Timeout(env, run.left / rate)
            run.timer.callbacks.append(resume)
            run.proc._target = run.timer

    # --- transfers -------------------------------------------------------------------------------

    def _finisher(self, ranks, done: Event, held: int) -> Callable[[], None]:
        """What a transfer among `ranks` holding `held` SMs on each does when it is over: their compute
        gets those SMs back, and whoever waits on it goes on."""

        def finish() -> None:
            self._comm_end(ranks, held)
            _fire(done)

        return finish

    def _comm_begin(self, ranks, held: int) -> None:
        if not held:
            return
        inflight, runs = self._inflight, self._runs
        for r in ranks:
            inflight[r] += held
            if runs[r]:
                self._rerate(r)

    def _comm_end(self, ranks, held: int) -> None:
        if not held:
            return
        inflight, runs = self._inflight, self._runs
        for r in ranks:
            inflight[r] -= held
            if runs[r]:
                self._rerate(r)
