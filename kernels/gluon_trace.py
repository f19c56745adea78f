"""Timestamps inside a Gluon kernel, for tracing where its time goes on the GPU (Hopper).

The GPU box has no Nsight Compute, so a warp-specialized kernel cannot be asked from outside how
long its producer waited for a free stage or its consumers for a loaded one. A kernel compiled
with its TRACE switch on reads the SM's cycle counter around those waits and at the edges of each
program (entry, first stage landed, last product done, end) and stores one record per program;
tools/trace_moe_gemms.py turns the records into the shares of the kernel's SM time. With TRACE off
the kernel compiles to the same code as without these helpers.

A record is RECORD_SLOTS int64 values per program (slot names below). Cycle counts come from
%clock64 (per SM, so only differences within one program mean anything); %globaltimer (ns) at a
program's entry and end places programs on a common time line and converts cycles to time.
"""

from __future__ import annotations

try:  # Gluon ships with triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    HAVE_GLUON = True
except ImportError:  # pragma: no cover
    HAVE_GLUON = False

# One program's record: what each int64 slot holds.
SLOTS = (
    "entry_ns",        # %globaltimer at the kernel body's first instruction
    "end_ns",          # %globaltimer after the program's last store has left
    "sm",              # %smid
    "entry_cycle",     # %clock64 at entry
    "first_ready_cycle",  # the first stage landed (consumer group 0)
    "last_product_cycle",  # group 0's last product done and its stage released
    "end_cycle",       # the program's last store has left (group 0)
    "ready_wait_0",    # cycles consumer group 0 waited for loaded stages, summed over its K steps
    "ready_wait_1",    # the same, group 1
    "ready_wait_2",    # the same, group 2
    "empty_wait",      # cycles the producer waited for free stages, summed
    "producer_entry_cycle",
    "last_issue_cycle",  # the producer issued its last load
    "work",            # K steps * 8 + (1 if group 0 holds rows) + 2 * (group 1) + 4 * (group 2)
)
RECORD_SLOTS = len(SLOTS)
SLOT = {name: i for i, name in enumerate(SLOTS)}

if HAVE_GLUON:
    # the slots as the kernels index them (a jit function reads only constexpr globals)
    ENTRY_NS = gl.constexpr(SLOT["entry_ns"])
    END_NS = gl.constexpr(SLOT["end_ns"])
    SM = gl.constexpr(SLOT["sm"])
    ENTRY_CYCLE = gl.constexpr(SLOT["entry_cycle"])
    FIRST_READY_CYCLE = gl.constexpr(SLOT["first_ready_cycle"])
    LAST_PRODUCT_CYCLE = gl.constexpr(SLOT["last_product_cycle"])
    END_CYCLE = gl.constexpr(SLOT["end_cycle"])
    READY_WAIT_0 = gl.constexpr(SLOT["ready_wait_0"])
    EMPTY_WAIT = gl.constexpr(SLOT["empty_wait"])
    PRODUCER_ENTRY_CYCLE = gl.constexpr(SLOT["producer_entry_cycle"])
    LAST_ISSUE_CYCLE = gl.constexpr(SLOT["last_issue_cycle"])
    WORK = gl.constexpr(SLOT["work"])
    RECORD = gl.constexpr(RECORD_SLOTS)

    @gluon.jit
    def clock():
        """The SM's cycle counter (%clock64); volatile, so it stays where it is written."""
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def clock32():
        """The low 32 bits of the cycle counter (%clock), for the waits: one register where clock()
        takes two, and a difference below 2^31 cycles (a second) wraps correctly."""
        return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def global_ns():
        """The GPU's nanosecond timer (%globaltimer), common to all SMs."""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def sm_id():
        """The SM this program runs on."""
        return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=True,
                                         pack=1).to(gl.int64)

    @gluon.jit
    def timed_wait(bar, phase, waited):
        """mbarrier.wait(bar, phase); `waited` plus the cycles it took."""
        c0 = clock32()
        mbarrier.wait(bar, phase)
        return waited + (clock32() - c0)

    @gluon.jit
    def first_stage(bar, rec, GROUP: gl.constexpr):
        """A consumer group's wait for the ring's first stage (bar: its ready barrier, phase 0), timed
        alone: group 0 records when it landed. The zero the group's wait counter starts from."""
        mbarrier.wait(bar, 0)
        if GROUP == 0:
            gl.store(rec + FIRST_READY_CYCLE, clock())
        return clock32() * 0
