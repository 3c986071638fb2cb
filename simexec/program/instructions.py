"""The program: per-rank lists of instructions, the one input of both interpreters.

The simulator prices each instruction against a hardware model; the executor runs it with real
tensors. An instruction's `id` (`<rank>:<name>`) is stable for a given plan, so predicted and
measured events match one to one. Members of one collective share its `name`; a send and its recv
share theirs too, so cross-rank matching needs no extra bookkeeping.

Streams run their instructions in order; `deps` add in-rank edges across streams. Streams:
`compute`, `comm.<axis>` (one per process group, as each NCCL/gloo group has its own stream),
`p2p.send`, `p2p.recv`, `copy.d2h`, `copy.h2d`, `copy.act` (activation offload), `host` (CPU optimizer).
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Iterator, Optional

from simexec.errors import SimexecError

if TYPE_CHECKING:
    from simexec.specs.plan import ResolvedPlan

KINDS = ("compute", "collective", "send", "recv", "copy", "memory")
PHASES = ("fwd", "bwd", "wgrad", "recompute", "optim", "setup", "")
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast")
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "workspace")


@dataclass(slots=True)
class Instr:
    """One step of one rank's program.

    compute:    `op` is the op class (gemm, attention, elementwise, embedding, loss, optimizer,
                cpu_optimizer); `flops` and `bytes` (memory traffic) price it.
    collective: `op` is e.g. `allreduce@tp`; `bytes` is the full tensor size per rank (the input of
                all-reduce/reduce-scatter/all-to-all, the output of all-gather); `group` its ranks.
    send/recv:  `peer` is the other rank, `bytes` the message.
    copy:       host<->device copy of `bytes`.
    memory:     zero-time `op` alloc/free of `bytes` in `category`.
    `block` names what the executor runs (sub-block, bucket or buffer); `items` lists the layers a
    gradient bucket or parameter gather covers (-1 embedding, L the LM head).
    """

    rank: int
    name: str
    kind: str
    stream: str
    op: str
    phase: str = ""
    block: str = ""
    layer: int = -1
    mb: int = -1
    chunk: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    deps: tuple[str, ...] = ()
    axis: str = ""
    group: tuple[int, ...] = ()
    peer: int = -1
    items: tuple[int, ...] = ()
    category: str = ""
    keys: float = 0.0  # attention on a GPU: the keys its average query attends to (Block.keys)
    gemm_groups: float = 0.0  # a grouped GEMM: the equal GEMMs its FLOPs split into (Block.gemm_groups)
    host_s: float = 0.0  # seconds the rank's host spends before the device can run it (its stream waits)

    @property
    def id(self) -> str:
        return f"{self.rank}:{self.name}"

    @property
    def collective(self) -> str:
        """Collective verb without the axis (`allreduce`), or '' for other kinds."""
        return self.op.split("@", 1)[0] if self.kind == "collective" else ""

    def to_text(self) -> str:
        """One line, `key=value` for every field that differs from its default; `from_text` inverts it."""
        parts = [f"{self.rank}:{self.name}", self.kind, self.stream, self.op]
        for f in fields(self)[5:]:
            val = getattr(self, f.name)
            if val == f.default:
                continue
            if isinstance(val, tuple):
                val = ",".join(str(v) for v in val)
            elif f.name in ("flops", "bytes", "keys", "gemm_groups", "host_s"):
                val = repr(float(val))
            parts.append(f"{f.name}={val}")
        return " ".join(parts)

    @staticmethod
    def from_text(line: str) -> "Instr":
        head, kind, stream, op, *rest = line.split()
        rank, name = head.split(":", 1)
        kw: dict[str, object] = {}
        for item in rest:
            key, val = item.split("=", 1)
            if key in ("deps",):
                kw[key] = tuple(val.split(",")) if val else ()
            elif key in ("group", "items"):
                kw[key] = tuple(int(v) for v in val.split(",")) if val else ()
            elif key in ("layer", "mb", "chunk", "peer"):
                kw[key] = int(val)
            elif key in ("flops", "bytes", "keys", "gemm_groups", "host_s"):
                kw[key] = float(val)
            else:
                kw[key] = val
        return Instr(rank=int(rank), name=name, kind=kind, stream=stream, op=op, **kw)


def exchanges_counts(ins: Instr) -> bool:
    """Whether a collective is a forward MoE dispatch, which the executor (like Megatron-LM's
    all-to-all token dispatcher) runs as two all-to-alls: each rank's per-expert token counts first
    (small, and the host waits for them: they size the receive buffers), then the tokens."""
    return ins.kind == "collective" and ins.block == "dispatch" and ins.phase != "bwd"


class ProgramError(SimexecError):
    """A program that cannot run: unmatched collectives or send/recv, unknown deps, cycles."""


@dataclass
class Program:
    """Per-rank instruction lists plus what produced them.

    `ranks` may hold only representative ranks (symmetric mode); `weights[r]` is how many real
    ranks rank r stands for, and `represents[r]` which ones.
    """

    meta: dict
    ranks: dict[int, list[Instr]]
    represents: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # what the lowering resolved (model, cluster, plan): not part of the text form, so a program read
    # back from its text has None and its readers fall back on `meta`
    resolved: Optional["ResolvedPlan"] = field(default=None, repr=False, compare=False)

    @property
    def symmetric(self) -> bool:
        return any(len(v) > 1 for v in self.represents.values())

    def __iter__(self) -> Iterator[Instr]:
        for rank in sorted(self.ranks):
            yield from self.ranks[rank]

    def __len__(self) -> int:
        return sum(len(v) for v in self.ranks.values())

    def to_text(self) -> str:
        return "\n".join(i.to_text() for i in self)

    @staticmethod
    def from_text(text: str, meta: Optional[dict] = None) -> "Program":
        ranks: dict[int, list[Instr]] = {}
        for line in text.splitlines():
            if line.strip():
                ins = Instr.from_text(line)
                ranks.setdefault(ins.rank, []).append(ins)
        return Program(meta=meta or {}, ranks=ranks)

    def fingerprint(self) -> str:
        """Hash of the program text: two traces of one plan share it."""
        return hashlib.sha256(self.to_text().encode()).hexdigest()[:16]

    def executed_fingerprint(self) -> str:
        """Hash of the instructions that run, without the simulator's prices: the memory markers hold
        its estimate of what the program holds, and a compute instruction's `flops`, `bytes` and `keys` its
        estimate of the work, which a better cost model changes while the executor runs the same
        instructions. A recorded trace stays comparable across such a change
        (`simexec.trace.compare.check_pair`); the messages' sizes, which the executor sends, stay in."""
        text = "\n".join((replace(i, flops=0.0, bytes=0.0, keys=0.0, gemm_groups=0.0) if i.kind == "compute" else i).to_text()
                         for i in self if i.kind != "memory")
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def counts(self) -> Counter:
        return Counter(i.kind for i in self)

    def grid(self, width: int = 12, stream: str = "compute", max_steps: int = 64) -> str:
        """Rank x step table of one stream's instructions (a quick look at a schedule)."""
        lines = []
        for rank in sorted(self.ranks):
            cells = [
                _short(i) for i in self.ranks[rank] if i.stream == stream and i.kind != "memory"
            ][:max_steps]
            lines.append(f"rank {rank:>4} | " + " ".join(c[:width].ljust(width) for c in cells))
        return "\n".join(lines)

    def validate(self) -> None:
        """Names unique per rank, deps known and earlier-or-acyclic, collectives and p2p matched."""
        for rank, instrs in self.ranks.items():
            seen: set[str] = set()
            for ins in instrs:
                if ins.name in seen:
                    raise ProgramError(f"rank {rank}: instruction {ins.name} appears twice")
                for d in ins.deps:
                    if d not in seen:
                        raise ProgramError(f"rank {rank}: {ins.name} waits on {d}, which does not come before it")
                seen.add(ins.name)
        full = not self.symmetric
        present = set(self.ranks)
        coll: dict[tuple[str, tuple[int, ...]], set[int]] = {}
        sends: dict[tuple[str, int, int], int] = {}
        recvs: dict[tuple[str, int, int], int] = {}
        for ins in self:
            if ins.kind == "collective":
                if ins.rank not in ins.group:
                    raise ProgramError(f"{ins.id}: rank {ins.rank} not in its own group {ins.group}")
                coll.setdefault((ins.name, ins.group), set()).add(ins.rank)
            elif ins.kind == "send":
                sends[(ins.name, ins.rank, ins.peer)] = 1
            elif ins.kind == "recv":
                recvs[(ins.name, ins.peer, ins.rank)] = 1
        for (name, group), members in coll.items():
            expected = set(group) & present if not full else set(group)
            if members != expected:
                missing = sorted(expected - members)
                raise ProgramError(f"collective {name} over {group}: ranks {missing} never issue it")
        for key in sends:
            if key[2] in present and key not in recvs:
                raise ProgramError(f"send {key[0]} from rank {key[1]} to {key[2]} has no matching recv")
        for key in recvs:
            if key[1] in present and key not in sends:
                raise ProgramError(f"recv {key[0]} on rank {key[2]} from {key[1]} has no matching send")


def _short(i: Instr) -> str:
    tag = {"fwd": "F", "bwd": "B", "wgrad": "W", "recompute": "R", "optim": "O"}.get(i.phase, "")
    return f"{tag}{i.block}{i.layer if i.layer >= 0 else ''}m{i.mb}" if i.mb >= 0 else f"{tag}{i.block}"

