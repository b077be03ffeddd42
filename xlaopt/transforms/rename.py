"""rename-instructions: prefix the names of chosen instructions in the compiled module.

Names are labels only in HLO (operands refer to instruction ids), so renaming never changes
what runs; it marks instructions for whoever reads the dumps, the notebook or a later pass
(e.g. the collectives a pass placed), and it is the smallest rewrite that shows a transform
reached XLA's module at its stage.
"""
from __future__ import annotations

import dataclasses

from xlaopt.transforms import HloTransform
from xlaopt.transforms.hlo_proto import INSTRUCTION_NAME, INSTRUCTION_OPCODE, map_instructions, string_field


@dataclasses.dataclass(frozen=True, kw_only=True)
class RenameInstructions(HloTransform):
    name = "rename-instructions"
    opcodes: tuple[str, ...]
    prefix: str

    def rewrite(self, module_proto: bytes) -> bytes | None:
        def rename(fields):
            old = string_field(fields, INSTRUCTION_NAME)
            if string_field(fields, INSTRUCTION_OPCODE) not in self.opcodes or old.startswith(self.prefix):
                return None
            return [(n, w, (self.prefix + old).encode() if n == INSTRUCTION_NAME else v) for n, w, v in fields]

        return map_instructions(module_proto, rename)
