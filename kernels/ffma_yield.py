"""Yield hints on the FP8 promotion FFMAs: a post-pass over a compiled sm_90 cubin.

Each consumer warp group of the 192-row FP8 GEMMs (kernels/moe_gluon.py) scales every K step's
product into its float32 sum with a run of 64 FFMA a thread. ptxas issues a run back to back and
marks each FFMA "do not yield" (each keeps the scale in the operand reuse cache for the next), so
a warp in its run holds its scheduler while the other groups' warps there wait to issue their next
products. Measured on an H100, the scaling adds ~196 cycles to a ~790-cycle gate/up K step at
16384 tokens, about the FFMA issue slots of the three groups, none of it overlapped
(docs/kernel-notes.md#what-paces-the-fp8-k-loop-measured-2026-12-08). DeepGEMM met the same cost
by editing the compiled SASS; Triton gives no handle on these bits, so this pass edits the cubin
Triton compiled, before its module is loaded: in each run of at least MIN_RUN FFMAs, every n-th
FFMA gets the yield hint and loses its reuse flags (a warp switched out after it cannot count on
the reuse cache). Only those two control fields change: the same instructions, operands, stall
counts and dependency barriers, so the same results bit for bit.

The sm_90 encoding, as read off ptxas's output (tests/test_triton_sm90_codegen.py checks it on the
compiled kernels against the cuobjdump that Triton ships; tests/test_ffma_yield.py the edit itself):
16 bytes an instruction, little endian; the opcode in the low 12 bits (0x223: FFMA with three
register sources); in the high 64-bit word, bit 45 is the yield flag (0 = may yield, which ptxas
sets on long stalls and never on an instruction with a reuse flag) and bits 58-61 are the operand
reuse flags (`.reuse` in the disassembly).
"""

from __future__ import annotations

import struct

INSTRUCTION_BYTES = 16
FFMA_REGISTERS = 0x223
OPCODE_MASK = 0xFFF
NO_YIELD_BIT = 1 << 45
REUSE_BITS = 0xF << 58
# The promotion runs are 23-41 FFMA (the gate/up's and down's 64 a step, split by the stage
# release); the activation's shorter runs in the epilogue are left as ptxas made them.
MIN_RUN = 16


def text_sections(cubin: bytes) -> dict[str, tuple[int, int]]:
    """The code sections of an ELF64 cubin: name -> (file offset, size)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("ffma_yield: not a little-endian ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = header(shstrndx)
    sections = {}
    for i in range(shnum):
        name_at, offset, size = header(i)
        end = cubin.index(b"\0", names_at + name_at)
        name = cubin[names_at + name_at:end].decode()
        if name.startswith(".text."):
            sections[name] = (offset, size)
    return sections


def _words(code: bytes | bytearray, i: int) -> tuple[int, int]:
    return struct.unpack_from("<QQ", code, i * INSTRUCTION_BYTES)


def ffma_runs(code: bytes | bytearray, min_run: int = MIN_RUN) -> list[list[int]]:
    """The indices of the instructions in each run of at least min_run consecutive register FFMAs."""
    runs, run = [], []
    for i in range(len(code) // INSTRUCTION_BYTES):
        low, _ = _words(code, i)
        if low & OPCODE_MASK == FFMA_REGISTERS:
            run.append(i)
            continue
        if len(run) >= min_run:
            runs.append(run)
        run = []
    if len(run) >= min_run:
        runs.append(run)
    return runs


def with_ffma_yields(cubin: bytes, every: int, min_run: int = MIN_RUN) -> tuple[bytes, int]:
    """cubin with the yield hint on every `every`-th FFMA of each run of at least min_run (the run's
    every-th, 2*every-th, ...), their reuse flags cleared; and how many FFMAs changed."""
    if every < 1:
        raise ValueError(f"ffma_yield: every must be a whole number >= 1, got {every}")
    out = bytearray(cubin)
    changed = 0
    for offset, size in text_sections(cubin).values():
        code = memoryview(out)[offset:offset + size]
        for run in ffma_runs(code, min_run):
            for i in run[every - 1::every]:
                low, high = _words(code, i)
                struct.pack_into("<QQ", code, i * INSTRUCTION_BYTES, low, high & ~(NO_YIELD_BIT | REUSE_BITS))
                changed += 1
    return bytes(out), changed


def apply_to_compiled(compiled, every: int) -> int:
    """Edit a Triton CompiledKernel's cubin in place before its module is loaded (its first launch
    loads it); once per kernel object. The FFMAs changed (0 where it was edited already)."""
    if getattr(compiled, "_ffma_yield_every", None) is not None:
        if compiled._ffma_yield_every != every:
            raise RuntimeError(f"ffma_yield: {compiled.name} was edited for every={compiled._ffma_yield_every}, "
                               f"asked for {every} (the kernel must key the setting: a constexpr)")
        return 0
    if compiled.module is not None:
        raise RuntimeError(f"ffma_yield: {compiled.name} is loaded already; edit it before its first launch")
    patched, changed = with_ffma_yields(compiled.kernel, every)
    if not changed:
        raise RuntimeError(f"ffma_yield: no run of {MIN_RUN} FFMAs in {compiled.name}: nothing to edit "
                           "(the kernel's promotion loop changed shape?)")
    compiled.kernel = patched
    compiled.asm["cubin"] = patched
    compiled._ffma_yield_every = every
    return changed
