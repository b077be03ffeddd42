"""What a pass is handed and what it hands back: `PassContext` (besides the program: the
cluster, the target compiler, a cache) and `PassResult`; `Pass` is the base every pass derives.

The cache holds what depends only on the model and its settings (abstract parameters and
state, the activations the model constrains), so a pipeline, or a planner pricing hundreds of
layouts of one model, traces the model once per distinct key instead of once per pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from xlaopt.program import TrainProgram


class ProgramCache:
    def __init__(self):
        self._memo: dict[tuple, Any] = {}
        self.misses = 0

    def _get(self, key: tuple, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self.misses += 1
            self._memo[key] = compute()
        return self._memo[key]

    def params_with_axes(self, program: TrainProgram):
        """(abstract params, logical PartitionSpec tree)."""
        from xlaopt import step

        key = ("params", program.model, program.settings.batch, program.execution)
        return self._get(key, lambda: step.abstract_params_with_axes(program))

    def abstract_state(self, program: TrainProgram):
        from xlaopt import step

        key = ("state", program.model, program.settings, program.execution)
        return self._get(key, lambda: step.abstract_state(program))

    def activation_axes(self, program: TrainProgram) -> list:
        """(shape, logical axes) of every activation the traced gradient function constrains."""
        from xlaopt import step

        key = ("activations", program.model, program.mesh, program.settings, program.execution,
               program.grad_transforms)
        return self._get(key, lambda: step.traced_activation_axes(program))


@dataclasses.dataclass(frozen=True)
class PassContext:
    target: str = "cpu"
    topology: Any = None  # a cluster topology (xlaopt.analysis.topology.Topology), when one is known
    cache: ProgramCache = dataclasses.field(default_factory=ProgramCache, compare=False)
    # Passes asked for by name (`--passes`): one that does not fit the program is an error, not skipped.
    requested: frozenset[str] = frozenset()

    @classmethod
    def for_program(cls, program: TrainProgram, topology: Any = None, requested=()) -> "PassContext":
        return cls(program.target, topology, requested=frozenset(requested))


@dataclasses.dataclass(frozen=True)
class PassResult:
    program: TrainProgram
    changed: bool
    report: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Pass:
    """A pass: a frozen dataclass whose fields are its options. The pipeline asks `why_not` first
    and skips the pass (or refuses it, when asked for by name) on a reason; `run` never mutates
    its input; after it the pipeline runs `ensures` on the result, the pass's own invariants.

    `name` and `summary` are the class's, not options an instance could override. A pass that is
    off unless enabled derives `OffUnlessEnabled` instead: one field and one reason for all.
    """
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def why_not(self, program: TrainProgram, ctx: PassContext) -> str | None:
        """Why the pass does not fit this program or target; None where it does."""
        return None

    def run(self, program: TrainProgram, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def ensures(self, before: TrainProgram, after: TrainProgram, ctx: PassContext) -> list[str]:
        """What is wrong with `after`, the program this pass returned for `before` (empty: nothing)."""
        return []


@dataclasses.dataclass(frozen=True)
class OffUnlessEnabled(Pass):
    """A pass that runs only when enabled (`--pass-option NAME.enabled=true`), for `off_because`."""
    off_because: ClassVar[str] = ""
    enabled: bool = False

    def off(self) -> str | None:
        if self.enabled:
            return None
        return f"off unless enabled (--pass-option {self.name}.enabled=true): {self.off_because}"
