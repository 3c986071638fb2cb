"""One rank's lowering: its concerns composed into one class."""
from __future__ import annotations

from simexec.program.blocks import Anatomy
from simexec.program.lowering.offload import ActivationOffload
from simexec.program.lowering.passes import StagePasses
from simexec.program.lowering.pipeline import PipelineLowering
from simexec.program.lowering.step import StepLowering
from simexec.program.schedules import Action
from simexec.specs.plan import ResolvedPlan


class RankLowering(PipelineLowering, StagePasses, StepLowering, ActivationOffload):
    """Builds one rank's instruction list (`build`). The concerns, each a mixin over `RankEmitter`
    (`simexec.program.lowering.emit`: the instruction list, the plan, the rank's groups):

    - `PipelineLowering` (pipeline.py): the schedule's actions in order, DualPipe's overlapped
      pairs, the sends and receives between stages;
    - `StagePasses` (passes.py): an action's pass over its stage's units, over `LayerLowering`
      (layers.py: a layer's, the head's and the embedding's blocks, cp and ep exchanges, recompute,
      the zero-bubble split) and `TensorParallel` (tensor_parallel.py: tp/sp collectives, tp_overlap);
    - `StepLowering` (step.py: model states, the step's end), over `GradientLowering`
      (gradients.py: buckets, ZeRO-1/2, tied embeddings) and `Zero3Lowering` (zero.py: ZeRO-3);
    - `ActivationOffload` (offload.py: `offload_layers`' copies to the host and back).
    """

    def __init__(self, rp: ResolvedPlan, an: Anatomy, rank: int, actions: list[Action]):
        super().__init__(rp, an, rank, actions)
        self.init_pipeline()
        self.init_zero3()
        self.init_gradients()
