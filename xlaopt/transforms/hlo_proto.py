"""Just enough of the protobuf wire format to rewrite an HloModuleProto's instructions.

jaxlib 0.10.2 ships no Python bindings for XLA's HLO protos, and an HLO transform receives
the module serialized. Fields this module does not touch are copied through byte for byte.
Field numbers from XLA's `xla/service/hlo.proto`: HloModuleProto.computations = 3,
HloComputationProto.instructions = 2, HloInstructionProto.name = 1 and .opcode = 2.
"""
from __future__ import annotations

from typing import Callable

Field = tuple[int, int, object]  # (number, wire type, value: int for varints, bytes otherwise)

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
MODULE_COMPUTATIONS, COMPUTATION_INSTRUCTIONS, INSTRUCTION_NAME, INSTRUCTION_OPCODE = 3, 2, 1, 2


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def parse(data: bytes) -> list[Field]:
    fields, i = [], 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _read_varint(data, i)
        elif wire == _BYTES:
            size, i = _read_varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            value, i = data[i:i + size], i + size
        else:
            raise ValueError(f"protobuf wire type {wire} (groups) is not used by HLO protos")
        fields.append((number, wire, value))
    return fields


def serialize(fields: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += _varint(number << 3 | wire)
        if wire == _VARINT:
            out += _varint(value)
        elif wire == _BYTES:
            out += _varint(len(value)) + value
        else:
            out += value
    return bytes(out)


def string_field(fields: list[Field], number: int) -> str:
    return next((v.decode() for n, w, v in fields if n == number and w == _BYTES), "")


def map_instructions(module_proto: bytes, fn: Callable[[list[Field]], list[Field] | None]) -> bytes | None:
    """Apply `fn` to every instruction's fields (None: leave it); None when nothing changed."""

    def rewrite_children(data: bytes, number: int, inner: Callable[[bytes], bytes | None]) -> bytes | None:
        fields, changed = [], False
        for n, w, v in parse(data):
            if n == number and w == _BYTES:
                new = inner(v)
                if new is not None:
                    v, changed = new, True
            fields.append((n, w, v))
        return serialize(fields) if changed else None

    def instruction(data: bytes) -> bytes | None:
        new = fn(parse(data))
        return None if new is None else serialize(new)

    return rewrite_children(module_proto, MODULE_COMPUTATIONS,
                            lambda computation: rewrite_children(computation, COMPUTATION_INSTRUCTIONS, instruction))
