"""The pipeline concern of a rank's lowering: the schedule's actions in order, grouped between
blocking exchanges or paired by DualPipe, and the messages between stages."""
from __future__ import annotations

from simexec.program.instructions import Instr
from simexec.program.lowering.emit import RankEmitter
from simexec.program.moe_overlap import moe_overlap_order
from simexec.program.schedules import Action, dualpipe_pairs, exchange_groups


def _segments(instrs: list[Instr]) -> list[list[Instr]]:
    """A pass cut before each compute instruction (and the workspace allocated for it): each piece
    is one compute and what follows it up to the next (its frees, the collectives and sends it
    issues); what comes before the first compute leads the first piece."""
    pieces: list[list[Instr]] = [[]]
    for k, ins in enumerate(instrs):
        starts = ins.kind == "compute" or (
            ins.kind == "memory" and ins.op == "alloc" and k + 1 < len(instrs)
            and instrs[k + 1].kind == "compute" and ins.name == f"mem.alloc.{instrs[k + 1].name}")
        if starts and any(i.kind == "compute" for i in pieces[-1]):
            pieces.append([])
        pieces[-1].append(ins)
    return [p for p in pieces if p]


def _interleave(a: list[list[Instr]], b: list[list[Instr]]) -> list[Instr]:
    """The pieces of two passes merged: a pass goes on until its next compute would wait for a
    collective it issued in the piece just placed, with nothing to run under it; the other pass's
    next piece runs there instead (DualPipe's pairing of one pass's compute with the other's
    communication)."""
    passes, at = (a, b), [0, 0]
    fresh: list[set[str]] = [set(), set()]  # collectives a pass issued with nothing placed after them yet
    out: list[Instr] = []
    cur = 0
    while at[0] < len(a) or at[1] < len(b):
        other = 1 - cur
        if at[cur] == len(passes[cur]):
            cur = other
            continue
        piece = passes[cur][at[cur]]
        waits = next((set(i.deps) for i in piece if i.kind == "compute"), set())
        if waits & fresh[cur] and at[other] < len(passes[other]):
            cur = other  # whose piece, placed next, covers those collectives
            continue
        out.extend(piece)
        at[cur] += 1
        fresh[other].clear()
        fresh[cur] = {i.name for i in piece if i.kind in ("collective", "recv")}
    return out


class PipelineLowering(RankEmitter):
    """The rank's schedule (`actions`) lowered in order, and its sends and receives; for
    `RankLowering`, whose passes (`forward`, `backward`, `weight_pass`) and step
    (`allocate_model_states`, `finish`) it calls."""

    def init_pipeline(self) -> None:
        self.received_inputs: set[Action] = set()  # actions whose input recv is already issued
        self.blocking_sends: list[str] = []  # p2p_overlap=0: this group's sends, waited before the next

    def build(self) -> list[Instr]:
        self.allocate_model_states()
        # DualPipe's pairs, by position in `self.actions` (dualpipev needs p2p_overlap=1: one action
        # per group, so a group's index is its action's)
        pairs = dualpipe_pairs(self.p.pp, self.pp_rank, self.micro_batches) if self.p.dualpipe_overlap else frozenset()
        paired = 3
        if self.p.moe_a2a_overlap:
            self.actions, pairs = moe_overlap_order(self.actions)
            paired = 2
        groups, i = self.exchange_groups(), 0
        while i < len(groups):
            if i in pairs:  # a forward, then another micro-batch's (DualPipe: the other chunk's) backward
                self.overlapped(self.actions[i], self.actions[i + 1:i + paired])
                i += paired
                continue
            group = groups[i]
            i += 1
            if not self.p.p2p_overlap:
                # Megatron-LM's blocking exchange between groups: it posts the group's receives with
                # the previous group's sends and waits for all of them before the group computes
                self.wait.extend(self.blocking_sends)
                self.blocking_sends = []
                for act in group:
                    self.receive_input(act)
            for act in group:
                self.action(act)
        self.finish()
        return self.out

    def action(self, act: Action) -> None:
        if act.kind == "F":
            self.forward(act)
        elif act.kind == "B":
            self.backward(act)
        else:
            self.weight_pass(act)

    def overlapped(self, fwd: Action, bwd: list[Action]) -> None:
        """DualPipe's overlapped pair: the forward and the backward lowered apart (neither waits on
        the other's collectives), then merged kernel by kernel, each compute instruction followed by
        what it issues, so that while one pass's collectives are in flight the other computes."""
        out, self.out = self.out, []  # the waits pending before the pair go to the forward's first compute
        self.action(fwd)
        f_out, f_wait = self.out, self.wait
        self.out, self.wait = [], []
        for act in bwd:
            self.action(act)
        b_out, b_wait = self.out, self.wait
        out.extend(_interleave(_segments(f_out), _segments(b_out)))
        self.out, self.wait = out, f_wait + b_wait

    def exchange_groups(self) -> list[list[Action]]:
        """The actions between two blocking pipeline exchanges (`simexec.program.schedules.exchange_groups`);
        one each where sends do not block (they are lowered alike)."""
        if self.p.pp == 1 or self.p.p2p_overlap:
            return [[a] for a in self.actions]
        p = self.p
        return exchange_groups(self.actions, p.schedule_name, p.pp, self.pp_rank, self.micro_batches, p.vpp)

    def receive_input(self, act: Action) -> None:
        """The recv (and gather) of an action's input, once: a stage's activations, or the gradient
        of its output."""
        if act in self.received_inputs:
            return
        self.received_inputs.add(act)
        vs = self.stage(act.chunk)
        if act.kind == "F" and vs > 0 and not self.holds(vs - 1):
            self.recv("act", vs - 1, act.mb)
        elif act.kind == "B" and vs < self.rp.virtual_stages - 1 and not self.holds(vs + 1):
            self.recv("grad", vs + 1, act.mb)

    def peer(self, vs: int) -> int:
        """The rank at this rank's other coordinates that holds virtual stage vs."""
        return self.rp.mesh.rank(**{**self.coords, "pp": self.rp.place(vs)[0]})

    def send(self, what: str, vs: int, mb: int, nbytes: float) -> None:
        """Send the output of virtual stage vs (activations forward, gradients backward): this rank's
        1/`pipeline_slices` of it."""
        dest = vs + 1 if what == "act" else vs - 1
        name = self.emit(Instr(self.rank, f"p2p.{what}.v{vs}.m{mb}", "send", "p2p.send", "send",
                               phase="fwd" if what == "act" else "bwd", block=what, mb=mb, chunk=self.rp.place(vs)[1],
                               bytes=nbytes / self.rp.pipeline_slices, deps=(self.last_compute(),),
                               peer=self.peer(dest)))
        if not self.p.p2p_overlap:  # a blocking send: the next group of actions waits for it
            self.blocking_sends.append(name)

    def recv(self, what: str, src_vs: int, mb: int) -> None:
        """Receive the input of a virtual stage; sliced over tp, the pieces are then all-gathered
        over tp (`<recv>.gather`, block `act_gather` / `grad_gather`) before the stage computes."""
        name = f"p2p.{what}.v{src_vs}.m{mb}"
        dest = src_vs + 1 if what == "act" else src_vs - 1
        phase, chunk, slices = "fwd" if what == "act" else "bwd", self.rp.place(dest)[1], self.rp.pipeline_slices
        self.emit(Instr(self.rank, name, "recv", "p2p.recv", "recv", phase=phase, block=what, mb=mb, chunk=chunk,
                        bytes=self.an.hidden_bytes / slices, peer=self.peer(src_vs)))
        if slices > 1:
            self.coll(f"{name}.gather", "allgather", "tp", self.groups.tp, self.an.hidden_bytes, (name,), phase=phase,
                      block=f"{what}_gather", mb=mb, chunk=chunk)
        else:
            self.wait.append(name)
