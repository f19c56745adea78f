"""kernels/ffma_yield.py on made-up code: which FFMAs it edits and which bits (no GPU, no compiler).
The same edit on the compiled FP8 192-row kernels, checked against cuobjdump's disassembly:
tests/test_triton_sm90_codegen.py; the results bit for bit on a GPU: tests/test_moe_triton.py."""

import struct

import pytest

from minimax_backend.kernels import ffma_yield as fy

# ptxas's control bits on an FFMA of a promotion run: stall 1, no yield, no barriers, reuse of operand b
FFMA_LOW = 0x0000001025667000 | fy.FFMA_REGISTERS
FFMA_HIGH = 0x080FC20000000000 | fy.NO_YIELD_BIT
OTHER_LOW = 0x00000000000079C5  # WARPGROUP.ARRIVE
OTHER_HIGH = 0x000FE20000000000 | fy.NO_YIELD_BIT


def elf_with_text(sections: dict[str, bytes]) -> bytes:
    """A minimal little-endian ELF64 with a section-name table and the given code sections."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    body, offsets = bytearray(names), []
    for code in sections.values():
        body += b"\0" * (-len(body) % 16)
        offsets.append(64 + len(body))
        body += code
    body += b"\0" * (-len(body) % 8)
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 2 + len(sections), 1)
    shdrs = bytearray(64)  # the null section
    shdrs += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0)
    name_at = len(b"\0.shstrtab\0")
    for (name, code), offset in zip(sections.items(), offsets):
        shdrs += struct.pack("<IIQQQQIIQQ", name_at, 1, 6, 0, offset, len(code), 0, 0, 16, 0)
        name_at += len(name) + 1
    return bytes(header + body + shdrs)


def code_of(kinds: str) -> bytes:
    """F = an FFMA as ptxas leaves a promotion run's, o = another instruction."""
    return b"".join(struct.pack("<QQ", FFMA_LOW, FFMA_HIGH) if k == "F" else struct.pack("<QQ", OTHER_LOW, OTHER_HIGH)
                    for k in kinds)


def instructions(cubin: bytes, name: str) -> list[tuple[int, int]]:
    offset, size = fy.text_sections(cubin)[name]
    return [struct.unpack_from("<QQ", cubin, offset + i) for i in range(0, size, 16)]


def test_finds_the_code_sections():
    cubin = elf_with_text({".text.gate_up": code_of("oFo"), ".text.down": code_of("FF")})
    sections = fy.text_sections(cubin)
    assert set(sections) == {".text.gate_up", ".text.down"}
    assert sections[".text.down"][1] == 32
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        fy.text_sections(b"\x7fELF\x01\x01" + bytes(58))


def test_runs_are_consecutive_register_ffmas_of_at_least_min_run():
    code = code_of("o" + "F" * 20 + "o" + "F" * 15 + "oo" + "F" * 16)
    runs = fy.ffma_runs(code, 16)
    assert [(r[0], len(r)) for r in runs] == [(1, 20), (39, 16)]  # the 15 are too short; a run may end the code
    # FFMA with an immediate or constant operand (other low bits above the opcode) is not a register FFMA
    assert fy.ffma_runs(struct.pack("<QQ", FFMA_LOW | 0x400, FFMA_HIGH) * 20, 16) == []


@pytest.mark.parametrize("every", [1, 2, 4])
def test_every_nth_ffma_of_a_run_yields_and_drops_its_reuse_flags_and_nothing_else_changes(every):
    kinds = "o" + "F" * 41 + "o" + "F" * 23 + "o" + "F" * 7 + "o"
    cubin = elf_with_text({".text.k": code_of(kinds)})
    patched, changed = fy.with_ffma_yields(cubin, every)
    want = [i for start, n in ((1, 41), (43, 23)) for i in range(start + every - 1, start + n, every)]
    assert changed == len(want)
    before, after = instructions(cubin, ".text.k"), instructions(patched, ".text.k")
    for i, ((lo0, hi0), (lo1, hi1)) in enumerate(zip(before, after)):
        assert lo1 == lo0, i
        if i in want:
            assert hi1 == hi0 & ~(fy.NO_YIELD_BIT | fy.REUSE_BITS), i
            assert hi1 & (fy.NO_YIELD_BIT | fy.REUSE_BITS) == 0
        else:
            assert hi1 == hi0, i
    offset, size = fy.text_sections(cubin)[".text.k"]
    assert patched[:offset] == cubin[:offset] and patched[offset + size:] == cubin[offset + size:]


def test_bad_settings_and_kernels_are_errors():
    cubin = elf_with_text({".text.k": code_of("F" * 20)})
    with pytest.raises(ValueError, match="every must be a whole number >= 1"):
        fy.with_ffma_yields(cubin, 0)

    class Compiled:  # what apply_to_compiled reads of Triton's CompiledKernel
        name, module = "k", None

        def __init__(self, kernel):
            self.kernel, self.asm = kernel, {"cubin": kernel}

    c = Compiled(cubin)
    assert fy.apply_to_compiled(c, 4) == 5
    assert c.kernel == c.asm["cubin"] != cubin
    assert fy.apply_to_compiled(c, 4) == 0  # once per kernel object
    with pytest.raises(RuntimeError, match="edited for every=4, asked for 2"):
        fy.apply_to_compiled(c, 2)
    loaded = Compiled(cubin)
    loaded.module = object()
    with pytest.raises(RuntimeError, match="loaded already"):
        fy.apply_to_compiled(loaded, 2)
    with pytest.raises(RuntimeError, match="no run of 16 FFMAs in k"):
        fy.apply_to_compiled(Compiled(elf_with_text({".text.k": code_of("oFFo")})), 2)
