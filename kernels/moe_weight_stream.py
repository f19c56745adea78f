"""The load side of the 192-row MoE GEMMs alone: how fast one program per SM streams an expert
stack's weights through a TMA ring of shared-memory stages (Hopper, Gluon).

At ~128 rows per expert (M3 at 4096 tokens) the gate/up reads each expert's weights once from
HBM, in [128, 128] FP8 tiles walking K (rows 6 KB apart), and each stage also carries the block's
64-row activation tiles, which 24 column tiles share from the L2. This kernel moves the same
tiles through the same kind of ring (one producer warp issuing the TMA loads, ready / empty
mbarriers per stage) to a consumer that releases each stage as soon as it lands, so its time is
what the loads cost with no math behind them: the ceiling of that load structure on the card, to
hold the GEMM kernels' weight rate against (docs/kernel-notes.md#what-the-gateups-loads-can-stream).
tools/bench_weight_stream.py runs it over ring depths and activation tiles per stage.
"""

from __future__ import annotations

import torch

from .moe_gluon import HAVE_GLUON, _ensure_allocator, gluon_available

WEIGHT_TILE_BYTES = 128 * 128  # one [128, 128] FP8 weight tile, as the gate/up stage holds
ROW_TILE_BYTES = 64 * 128  # one 64-row activation tile
ROWS_PER_BLOCK = 192  # the activation rows a block's three tiles cover
SHARED_BYTES_SM90 = 232448  # what one program may allocate on an H100 / H200
COLUMN_TILES_PER_EXPERT = 24  # M3: 3072 columns of h / 128, the programs that share a block's rows

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from .moe_gluon import _tma_load

    @gluon.jit
    def _stream_producer(w_desc, a_desc, w_smem, a_smem, ready, empty, n_slabs, row_sets, K: gl.constexpr,
                         STAGES: gl.constexpr, A_TILES: gl.constexpr, SLABS_PER_ROWS: gl.constexpr):
        """The producer warp: for each of this program's 128-row weight slabs and each K step, the
        weight tile and A_TILES activation tiles of the slab's rows into the next free stage."""
        it = 0
        for slab in range(gl.program_id(0), n_slabs, gl.num_programs(0)):
            a_row = ((slab // SLABS_PER_ROWS) % row_sets) * 192
            for kk in range(K // 128):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, w_desc.block_type.nbytes + A_TILES * a_desc.block_type.nbytes)
                _tma_load(w_desc, [slab * 128, kk * 128], bar, w_smem.index(s))
                for t in gl.static_range(A_TILES):
                    _tma_load(a_desc, [a_row + 64 * t, kk * 128], bar, a_smem.index(s * A_TILES + t))
                it += 1

    @gluon.jit
    def _stream_consumer(ready, empty, n_slabs, K: gl.constexpr, STAGES: gl.constexpr):
        """Each stage released as soon as its loads landed."""
        it = 0
        for slab in range(gl.program_id(0), n_slabs, gl.num_programs(0)):
            for kk in range(K // 128):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                mbarrier.arrive(empty.index(s), count=1)
                it += 1

    @gluon.jit
    def _stream_kernel(w_ptr, a_ptr, rows_w, rows_a, n_slabs, row_sets, K: gl.constexpr, STAGES: gl.constexpr,
                       A_TILES: gl.constexpr, SLABS_PER_ROWS: gl.constexpr, num_warps: gl.constexpr):
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        w_desc = tma.make_tensor_descriptor(w_ptr, shape=[rows_w, K], strides=[K, 1], block_shape=[128, 128],
                                            layout=layout)
        a_desc = tma.make_tensor_descriptor(a_ptr, shape=[rows_a, K], strides=[K, 1], block_shape=[64, 128],
                                            layout=layout)
        w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], layout)
        # one placeholder tile without activation tiles (the compiler drops it, unused)
        A_BUFFERS: gl.constexpr = max(STAGES * A_TILES, 1)
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [A_BUFFERS, 64, 128], layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize([
            (_stream_consumer, (ready, empty, n_slabs, K, STAGES)),
            (_stream_producer, (w_desc, a_desc, w_smem, a_smem, ready, empty, n_slabs, row_sets, K, STAGES, A_TILES,
                                SLABS_PER_ROWS)),
        ], [1], [24])


def ring_shared_bytes(stages: int, a_tiles: int) -> int:
    """Shared memory of one program's ring: the stages' weight and activation tiles (without
    activation tiles the compiler drops the one placeholder tile the kernel allocates)."""
    return stages * (WEIGHT_TILE_BYTES + a_tiles * ROW_TILE_BYTES)


def check_ring(stages: int, a_tiles: int, programs_per_sm: int) -> None:
    """A ValueError naming what does not fit: at least 2 stages, 0-3 activation tiles a stage (the
    192-row block's three), and the programs per SM's rings within the SM's shared memory."""
    if stages < 2:
        raise ValueError(f"moe_weight_stream: {stages} stages; a ring needs at least 2")
    if not 0 <= a_tiles <= 3:
        raise ValueError(f"moe_weight_stream: {a_tiles} activation tiles a stage; 0 to 3 (a 192-row block's)")
    if programs_per_sm < 1:
        raise ValueError(f"moe_weight_stream: {programs_per_sm} programs per SM; at least 1")
    need = programs_per_sm * (ring_shared_bytes(stages, a_tiles) + 1024)  # + barriers and alignment
    if need > SHARED_BYTES_SM90:
        raise ValueError(f"moe_weight_stream: {programs_per_sm} program(s) of {stages} stages with {a_tiles} "
                         f"activation tiles need {need} bytes of shared memory per SM, more than the "
                         f"{SHARED_BYTES_SM90} an sm_90 SM has")


def stream_weights(w: torch.Tensor, rows: torch.Tensor, stages: int, a_tiles: int, programs_per_sm: int = 1,
                   slabs_per_rows: int = COLUMN_TILES_PER_EXPERT) -> None:
    """Stream w [R, K] (FP8, R and K multiples of 128) through the ring once, 128-row slabs over
    programs_per_sm programs per SM; each stage also loads a_tiles 64-row tiles of rows [192 * S, K]
    (the same 192 rows for slabs_per_rows consecutive slabs, as the column tiles of one block)."""
    if not gluon_available(w.device):
        raise RuntimeError("moe_weight_stream needs triton's Gluon and an sm_90 GPU (H100 / H200)")
    check_ring(stages, a_tiles, programs_per_sm)
    if w.dtype != torch.float8_e4m3fn or rows.dtype != torch.float8_e4m3fn:
        raise ValueError(f"moe_weight_stream: weights {w.dtype} and rows {rows.dtype}; FP8 (e4m3) expected")
    if w.dim() != 2 or w.shape[0] % 128 or w.shape[1] % 128 or not w.is_contiguous():
        raise ValueError(f"moe_weight_stream: weights {tuple(w.shape)}; a contiguous [R, K] with R and K "
                         "multiples of 128")
    if rows.dim() != 2 or rows.shape[1] != w.shape[1] or rows.shape[0] % ROWS_PER_BLOCK or rows.shape[0] == 0 \
            or not rows.is_contiguous():
        raise ValueError(f"moe_weight_stream: rows {tuple(rows.shape)} for weights {tuple(w.shape)}; a contiguous "
                         f"[192 * S, K] with the weights' K")
    _ensure_allocator()
    sms = torch.cuda.get_device_properties(w.device).multi_processor_count
    n_slabs = w.shape[0] // 128
    _stream_kernel[(min(sms * programs_per_sm, n_slabs), )](
        w, rows, w.shape[0], rows.shape[0], n_slabs, rows.shape[0] // ROWS_PER_BLOCK, K=w.shape[1], STAGES=stages,
        A_TILES=a_tiles, SLABS_PER_ROWS=slabs_per_rows, num_warps=4)
