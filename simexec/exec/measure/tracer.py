"""Measured events of a real run, in the one trace schema (`simexec.trace.schema`).

On every rank the interpreter calls `tracer.begin(ins, step)` when it issues an instruction and
`tracer.end(ins, step)` when its result is ready (for an asynchronous collective: after `wait()`).
Begin and end may interleave (a collective in flight while compute runs). The tracer

- stamps them with `time.perf_counter_ns` on CPU, or CUDA events on GPU (recorded on the current
  stream, so call begin/end under the stream the instruction runs on), converted to host time
  through one reference event per step taken right after a `torch.cuda.synchronize()`;
- keeps `current`, `step` and `count` (instructions begun) for the driver's watchdog, which reads
  them from another thread while this one may be blocked in a collective;
- fires an injected fault (`Fault`) at a chosen instruction, for the fault tests;
- records memory samples the interpreter reports with `counter(category, bytes)`.

Which steps go into the trace: every step is recorded, but `build_events` keeps one (`pick_step`:
the steady step, whose time is the median of the second half of the run's steps; the last step of
a short run) so that instruction ids stay unique and match the simulator's one step one to one. A
failed run's trace keeps the last step that has any events.

Clocks: each rank notes `time.time_ns() - time.perf_counter_ns()` (so its perf clock maps to the
host's wall clock, shared by all processes of a host) and its perf clock when leaving a barrier.
Ranks on one host are aligned through the wall clock, which is exact; other hosts are shifted so
that the median barrier exits coincide (wall clocks of two hosts may differ by milliseconds).

Overhead: two clock reads, a dict store and a list append per instruction (about 2 µs on this CPU;
about 6 µs of host time with CUDA events on an H100, hidden when the GPU is the bottleneck);
with `enabled=False` only `current`/`count` are kept.
"""
from __future__ import annotations

import os
import signal
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from simexec.errors import ExecError
from simexec.trace.schema import Counter, Event

FAULT_ENV = "SIMEXEC_FAULT"
FAULT_MODES = ("raise", "hang", "kill")


class InjectedFault(RuntimeError):
    """Raised by a `Fault` in mode `raise`."""


@dataclass(frozen=True)
class Fault:
    """Make rank `rank` fail when it begins instruction `at` of step `step`.

    `at` is an instruction name or an index (the n-th instruction begun in that step, from 0).
    mode `raise`: an exception; `hang`: block forever; `kill`: SIGKILL its own process (the same as
    an actor killed from outside, or the OOM killer).
    Text form, also read from the environment variable SIMEXEC_FAULT:
    `rank=1,step=1,at=fwd.qkv.L0.m0,mode=raise`.
    """

    rank: int
    at: str | int = 0
    step: int = 0
    mode: str = "raise"

    @staticmethod
    def parse(text: str) -> "Fault":
        kw: dict = {}
        try:
            for item in filter(None, (p.strip() for p in text.split(","))):
                key, val = item.split("=", 1)
                key, val = key.strip(), val.strip()
                if key in ("rank", "step"):
                    kw[key] = int(val)
                elif key == "at":
                    kw[key] = int(val) if val.lstrip("-").isdigit() else val
                elif key == "mode":
                    kw[key] = val
                else:
                    raise ValueError(f"unknown key {key!r}")
            fault = Fault(**kw)
        except (ValueError, TypeError) as exc:
            raise ExecError(f"fault {text!r}: {exc} (expected rank=R,step=S,at=NAME|INDEX,mode=raise|hang|kill)") from None
        if fault.mode not in FAULT_MODES:
            raise ExecError(f"fault {text!r}: mode must be one of {', '.join(FAULT_MODES)}")
        return fault

    def fire(self, rank: int, name: str, step: int) -> None:
        if self.mode == "raise":
            raise InjectedFault(f"injected fault on rank {rank} at {name} (step {step})")
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()  # hang: forever, until the driver kills this process


class Tracer:
    """Per-rank recorder of instruction begin/end times; see the module docstring."""

    def __init__(self, rank: int, *, device: object = None, enabled: bool = True,
                 fault: Optional[Fault] = None, profile: bool = False):
        self.rank = rank
        self.enabled = enabled
        self.step = -1
        self.current = ""  # name of the instruction begun last
        self.count = 0  # instructions begun in all steps: the watchdog's progress measure
        self._in_step = 0
        self.records: list[tuple[str, int, object, object]] = []  # (name, step, t0, t1)
        self.samples: list[tuple[object, str, float]] = []  # (t, category, bytes)
        self._open: dict[str, object] = {}
        self._fault = fault if fault is not None and fault.rank == rank else None
        self._cuda = getattr(device, "type", "cpu") == "cuda"
        self._refs: dict[int, tuple[object, int]] = {}  # cuda: step -> (event, host ns)
        self._free: list = []  # cuda: events whose times were read, for reuse
        self._settled = 0  # cuda: records before this index hold host ns
        self._streams: dict[int, object] = {}
        self._device_index = getattr(device, "index", None) or 0
        self._thread = threading.current_thread()
        self._ranges: Optional[dict[str, object]] = {} if profile else None
        self.clock = {"host": socket.gethostname(), "wall_minus_perf_ns": _wall_minus_perf(), "barrier_ns": None}
        self._now: Callable[[], object] = self._cuda_now if self._cuda else time.perf_counter_ns

    # --- the interpreter's side -------------------------------------------------------------------
    def begin(self, ins, step: int) -> None:
        if step != self.step:
            self._new_step(step)
        self.current = ins.name
        self.count += 1
        if self._fault is not None and self._fault.step == step and self._fault.at in (ins.name, self._in_step):
            self._open[ins.name] = 0  # the rank is inside this instruction when it fails
            self._fault.fire(self.rank, ins.name, step)
        self._in_step += 1
        if self.enabled:
            if self._ranges is not None:
                self._range_begin(ins.name)
            self._open[ins.name] = self._now()

    def end(self, ins, step: int) -> None:
        if self.enabled:
            t1 = self._now()
            t0 = self._open.pop(ins.name, None)
            if t0 is not None:
                self.records.append((ins.name, step, t0, t1))
            if self._ranges is not None:
                self._range_end(ins.name)

    def counter(self, category: str, nbytes: float) -> None:
        """Live bytes of `category` from now on (memory counters of the trace)."""
        if self.enabled:
            self.samples.append((time.perf_counter_ns(), category, float(nbytes)))  # host time suffices

    def status(self) -> dict:
        """Where this rank is; `open`: instructions begun and not ended (a compute running, a
        collective in flight or being waited on). Read from another thread while this one runs."""
        for _ in range(10):
            try:
                open_ = list(self._open)
                break
            except RuntimeError:  # resized by the running thread meanwhile
                open_ = []
        return {"step": self.step, "current": self.current, "count": self.count, "open": open_}

    # --- the worker's side ------------------------------------------------------------------------
    def sync_clock(self, barrier: Callable[[], None]) -> None:
        """Note where this rank's clock stands when leaving a barrier all ranks enter."""
        barrier()
        self.clock["barrier_ns"] = time.perf_counter_ns()
        self.clock["wall_minus_perf_ns"] = _wall_minus_perf()

    def export(self) -> dict:
        """Records with host perf-clock nanoseconds, ready to pickle to the driver."""
        if self._cuda:
            import torch

            if threading.current_thread() is self._thread:
                torch.cuda.synchronize()
                self._settle()
            records = [(n, s, self._to_ns(t0, s), self._to_ns(t1, s)) for n, s, t0, t1 in list(self.records)]
            records = [r for r in records if r[2] is not None and r[3] is not None]
        else:
            records = list(self.records)
        samples = list(self.samples)
        return {"rank": self.rank, "records": records, "samples": samples, "clock": dict(self.clock),
                "status": self.status()}

    # --- internals --------------------------------------------------------------------------------
    def _new_step(self, step: int) -> None:
        self.step = step
        self._in_step = 0
        if self._cuda:
            import torch

            torch.cuda.synchronize()  # the reference event then fires at the host time we note
            self._settle()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._refs[step] = (ev, time.perf_counter_ns())

    def _settle(self) -> None:
        """CUDA: turn finished records' events into host ns and recycle the events, so that a step
        reuses events already created on the device (H100: a record ~3 µs instead of ~4.5, reading
        one ~2 µs, both on the host; hidden when the GPU is the bottleneck)."""
        for i in range(self._settled, len(self.records)):
            name, s, t0, t1 = self.records[i]
            self.records[i] = (name, s, self._to_ns(t0, s, True), self._to_ns(t1, s, True))
            self._free.extend(t for t in (t0, t1) if not isinstance(t, int))
        self._settled = len(self.records)

    def _cuda_now(self) -> object:
        import torch

        raw = torch._C._cuda_getCurrentRawStream(self._device_index)
        stream = self._streams.get(raw)
        if stream is None:  # torch.cuda.current_stream() costs ~5 µs: look it up once per stream
            stream = self._streams[raw] = torch.cuda.current_stream()
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _to_ns(self, ev, step: int, synced: bool = False) -> Optional[int]:
        """Host ns of a CUDA event (None if it has not fired); `synced`: the device is idle."""
        if ev is None or isinstance(ev, int):
            return ev
        ref = self._refs.get(step)
        try:
            if ref is None or not (synced or ev.query()):
                return None
            return ref[1] + int(ref[0].elapsed_time(ev) * 1e6)
        except RuntimeError:
            return None

    def _range_begin(self, name: str) -> None:
        import torch

        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        self._ranges[name] = rf

    def _range_end(self, name: str) -> None:
        rf = self._ranges.pop(name, None)
        if rf is not None:
            rf.__exit__(None, None, None)


def torch_profiler(device):
    """A torch.profiler session for one rank: its CPU operators with their shapes, and its kernels on
    a GPU, with the tracer's instruction ranges (`Tracer(profile=True)`) among them."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if getattr(device, "type", "cpu") == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True)


def chrome_text(prof) -> str:
    """Kineto's Chrome trace as text: shipped to the driver, which may be on another node."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return fh.read()


def _wall_minus_perf() -> int:
    return int(statistics.median(time.time_ns() - time.perf_counter_ns() for _ in range(7)))


# --- driver side: exports of all ranks -> one measured trace ---------------------------------------
def clock_offsets(clocks: dict[int, dict]) -> dict[int, int]:
    """Per rank, nanoseconds to add to its perf clock to land on one common clock.

    Same host: its wall clock (exact). Other hosts: shifted so that their median barrier exit, in
    wall time, matches that of the host of the lowest rank.
    """
    wall = {r: c["wall_minus_perf_ns"] for r, c in clocks.items()}
    exits: dict[str, list[int]] = {}
    for r, c in clocks.items():
        if c.get("barrier_ns") is not None:
            exits.setdefault(c["host"], []).append(c["barrier_ns"] + wall[r])
    ref_host = clocks[min(clocks)]["host"]
    shift = {h: 0 for h in exits}
    if ref_host in exits:
        ref = statistics.median(exits[ref_host])
        shift = {h: int(statistics.median(v) - ref) for h, v in exits.items()}
    return {r: wall[r] - shift.get(c["host"], 0) for r, c in clocks.items()}


def pick_step(exports: Iterable[dict], step_times: Sequence[float] = ()) -> int:
    """The step the trace keeps (-1 if none has events). With the run's step times (4 or more): the
    steady step, the one of the second half whose time is nearest that half's median (the run's
    steady-state step time, `simexec.trace.schema.steady_step`), so that the trace shows what
    the step time measures and not a step a stall happened to hit. Else the last step with any event."""
    from simexec.trace.schema import steady_step

    recorded = {rec[1] for ex in exports for rec in ex["records"]}
    if not recorded:
        return -1
    mid = steady_step(step_times)
    half = [(s, t) for s, t in enumerate(step_times) if s >= len(step_times) // 2 and s in recorded and t]
    if mid is None or not half:
        return max(recorded)
    return min(half, key=lambda st: (abs(st[1] - mid), -st[0]))[0]


def build_events(program, exports: dict[int, dict], step: Optional[int] = None) -> tuple[list[Event], list[Counter]]:
    """Events and memory counters of one step (default: the last recorded), in µs from that step's
    earliest begin on any rank."""
    if step is None:
        step = pick_step(exports.values())
    offsets = clock_offsets({r: ex["clock"] for r, ex in exports.items()})
    lookup = {r: {i.name: i for i in instrs} for r, instrs in program.ranks.items()}
    rows = []
    for r, ex in exports.items():
        for name, s, t0, t1 in ex["records"]:
            if s == step:
                rows.append((r, name, t0 + offsets[r], t1 + offsets[r]))
    origin = min((row[2] for row in rows), default=0)
    events = []
    for r, name, t0, t1 in sorted(rows, key=lambda x: (x[0], x[2])):
        ins = lookup.get(r, {}).get(name)
        if ins is None:
            raise ExecError(f"rank {r} traced {name}, which is not in its program")
        events.append(Event(id=ins.id, rank=r, stream=ins.stream, name=ins.name, kind=ins.kind, op=ins.op,
                            start_us=(t0 - origin) / 1e3, dur_us=max(0, t1 - t0) / 1e3, phase=ins.phase,
                            layer=ins.layer, mb=ins.mb, flops=ins.flops, bytes=ins.bytes))
    step_end = max((row[3] for row in rows), default=origin)
    counters = []
    for r, ex in exports.items():
        before: dict[str, float] = {}  # live bytes when the step starts (e.g. params set up earlier)
        for t, cat, nbytes in sorted(ex["samples"], key=lambda x: x[0]):
            g = t + offsets[r]
            if g < origin:
                before[cat] = nbytes
            elif g <= step_end:
                counters.append(Counter(rank=r, ts_us=(g - origin) / 1e3, category=cat, bytes=nbytes))
        counters.extend(Counter(rank=r, ts_us=0.0, category=c, bytes=b) for c, b in before.items())
    counters.sort(key=lambda c: (c.rank, c.ts_us))
    return events, counters
