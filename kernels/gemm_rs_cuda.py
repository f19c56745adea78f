"""GEMM overlapped with the reduce-scatter of its result, over NVLink (CUDA).

The fused path of ``minimax::gemm_rs`` (see kernels/gemm_rs.py); this module
registers the op's CUDA kernel (the end of the file): the fused path from
``min_tokens`` rows on where symmetric memory works, else the op's reference
(matmul + reduce-scatter). With W ranks
and M' = M + pad rows, rank d owns output rows [d*m, (d+1)*m), m = M'/W, cut
into pieces (push_pieces). Every rank holds a symmetric-memory buffer
``sym [W, m, N]``: slot s receives rank s's partial sum of the rows this rank
owns. One call, on rank r:

    barrier (side stream)                       every peer finished reading its slots
    for each piece p:
        for d in r+1, ..., r+W-1 (mod W):        peers' rows first
            GEMM d's piece p -> stage[d]         (main stream, cuBLAS writes in place)
            copy it -> rank d's sym[r]           (side stream, copy engine) ... while the next GEMM runs
        [epilogue: barrier (side stream)]        piece p of every peer has landed in my slots
    then my own rows, in one of two schedules (choose_schedule: by M' x K):

    sum_after (small GEMMs):  GEMM my rows -> sym[r] beside the last push; barrier; out = sum of the W slots
    epilogue (large GEMMs):   for each piece p: wait for piece p;
                                W = 2: out[p] = GEMM + the peer's slot, added in the GEMM's epilogue
                                       (one cuBLASLt call, kernels/cublaslt_gemm.py)
                                W > 2: GEMM -> sym[r]; out[p] = sum over the W slots (one rounding)

The final sum of sum_after costs a pass over [m, N] after the last GEMM that no
overlap hides; the epilogue schedule removes it, at the price of a barrier and
an event wait per piece and smaller GEMMs, which pays for large GEMMs only
(measured: docs/kernel-notes.md#gemm-rs-final-sum).

The kernel option gemm_rs_push=store (``MINIMAX_GEMM_RS_PUSH``; kernels/options.py
has every switch) makes the GEMMs write the peers' slots directly instead
(see push_mode; slower on the H200). The copies are plain ``Tensor.copy_``
into the peer's buffer mapped in our address space, i.e. ``cudaMemcpyAsync`` on the copy engine: no SMs are taken
from the GEMM, and no NVLink multicast / multimem instruction is used
(``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set before the first allocation
unless the caller set it). Every step is a stream operation (GEMM, event
waits, memcpy, symmetric-memory barrier kernel), so the whole op can be
captured in a CUDA graph.

Buffers: one workspace per (device, group, rows per rank, N, dtype),
allocated and rendezvoused on first use (a collective: all ranks call the op
with the same shapes, as the graph guarantees) and kept for the life of the
process, so pointers baked into a CUDA graph stay valid. The first call for a
shape may not happen during CUDA-graph capture (allocation + rendezvous
cannot be captured): run the op once before capture (torch.compile's
cudagraph warm-up does) or call ``prepare()``; otherwise a ``RuntimeError``
says so.

torch API used (present in 2.11 and 2.13): ``torch.distributed.
_symmetric_memory.empty / rendezvous``, and on the handle ``barrier(channel)``,
``rank``, ``world_size``, ``get_remote_tensor`` (``get_buffer`` if absent).
Never call ``destroy_process_group()`` after using this module on the GPU box:
it hung there (docs/kernel-notes.md#gemm-rs-teardown).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from .cublaslt_gemm import try_matmul_add
from .fp8_gemm_cuda import fp8_block_gemm_cuda
from .gemm_rs import check_args, gemm_rs, gemm_rs_reference, local_gemm
from .options import kernel_options

log = logging.getLogger("minimax")

__all__ = ["fused_available", "gemm_rs_fused", "prepare", "push_pieces", "piece_bounds", "workspace_count"]

# The switches (kernels/options.py): gemm_rs_fused (False: always matmul + reduce-scatter),
# gemm_rs_pieces (pieces per row block; None: push_pieces), gemm_rs_schedule (auto, epilogue
# or sum_after), gemm_rs_push (copy: the copy engine; store: the GEMM writes the peer's slot).
EPILOGUE_MIN_WORK = 12 << 20  # M' x K_eff from which the epilogue schedule is faster (see choose_schedule)
EPILOGUE_MIN_K = 2048  # K_eff below which it never is
FP8_K_FACTOR = 0.6  # an FP8 GEMM takes about as long as a BF16 one of 0.6 x its K (docs/kernel-notes.md#gemm-rs-schedule)
DEFAULT_PIECES = 2
SMALL_K = 2048  # sum_after: pieces only at K <= SMALL_K
MIN_PIECE_ROWS = 256  # below, one piece
PIECE_ALIGN = 128  # piece boundaries on whole GEMM tiles (and FP8 scale rows in multiples of 4)


# ---------------------------------------------------------------- workspaces
@dataclass
class _Workspace:
    """Symmetric buffer + staging + side stream for one (group, shape, dtype)."""

    rank: int
    world: int
    rows: int  # output rows per rank (m)
    sym: torch.Tensor  # [W, m, N] symmetric: slot s = rank s's partial of my rows
    peers: list  # peers[d] = rank d's `sym`, mapped here ([W, m, N])
    stage: Optional[torch.Tensor]  # [W, m, N] local: GEMM output bound for rank d (copy push only; made on first use)
    handle: object = None  # the _SymmetricMemory handle (barrier)
    comm: Optional[torch.cuda.Stream] = None  # side stream for the copies
    arrived: list = field(default_factory=list)  # arrived[p]: event on `comm` after piece p's barrier
    pushes: list = field(default_factory=list)  # (dst, src) of the last call, for tests

    # Stream plumbing; the CPU simulation in the tests replaces these with no-ops.
    def barrier(self) -> None:
        self.handle.barrier(channel=0)

    def fork(self) -> None:
        """The side stream waits for everything issued so far on the main stream."""
        self.comm.wait_stream(torch.cuda.current_stream())

    def side(self):
        return torch.cuda.stream(self.comm)

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.comm)

    def mark_arrived(self, piece: int) -> None:
        """(On the side stream, after piece `piece`'s barrier.)"""
        while len(self.arrived) <= piece:
            self.arrived.append(torch.cuda.Event())
        self.arrived[piece].record(self.comm)

    def wait_arrived(self, piece: int) -> None:
        torch.cuda.current_stream().wait_event(self.arrived[piece])


_WORKSPACES: dict[tuple, _Workspace] = {}
_FUSED_OK: dict[str, bool] = {}
_SAID: set = set()  # run-time choices already logged


def workspace_count() -> int:
    return len(_WORKSPACES)


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _resolve_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _torch_before(major: int, minor: int) -> bool:
    try:
        have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return have < (major, minor)


def _peer_view(handle, peer: int, shape, dtype) -> torch.Tensor:
    # get_remote_tensor accounts for the tensor's offset inside its symmetric
    # allocation (pooled allocations); get_buffer counts from the allocation start.
    if hasattr(handle, "get_remote_tensor"):
        return handle.get_remote_tensor(peer, shape, dtype)
    return handle.get_buffer(peer, shape, dtype, 0)


def _workspace(rows: int, n: int, dtype: torch.dtype, group_name: str, device: torch.device) -> _Workspace:
    key = (device.index, group_name, rows, n, dtype)
    ws = _WORKSPACES.get(key)
    if ws is not None:
        return ws
    if _is_capturing():
        raise RuntimeError(
            f"minimax::gemm_rs: no symmetric-memory workspace yet for {rows} rows/rank x {n} {dtype} on group "
            f"{group_name!r}, and allocating + rendezvousing one cannot happen during CUDA graph capture. Run the "
            "op once at this token count before capturing (torch.compile's cudagraph warm-up does), or call "
            "minimax_backend.kernels.gemm_rs_cuda.prepare(tokens, n, dtype, group_name) first."
        )
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # we never use multicast
    import torch.distributed._symmetric_memory as symm_mem

    world = _resolve_group(group_name).size()
    shape = (world, rows, n)
    try:
        if _torch_before(2, 11) and not symm_mem.is_symm_mem_enabled_for_group(group_name):
            symm_mem.enable_symm_mem_for_group(group_name)  # needed before 2.11, deprecated since
        sym = symm_mem.empty(shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(sym, group_name)  # collective over the group
    except Exception as e:
        raise RuntimeError(
            f"minimax::gemm_rs: could not set up symmetric memory for group {group_name!r} ({type(e).__name__}: "
            f"{e}). The overlapped path needs all ranks of the group on NVLink-connected GPUs of one host; set "
            "MINIMAX_GEMM_RS_FUSED=0 (or raise gemm_rs_min_tokens) to use matmul + reduce-scatter instead."
        ) from e
    if handle.world_size != world:
        raise RuntimeError(f"minimax::gemm_rs: symmetric memory reports {handle.world_size} ranks, group has {world}")
    peers = [sym if d == handle.rank else _peer_view(handle, d, shape, dtype) for d in range(world)]
    ws = _Workspace(
        rank=handle.rank, world=world, rows=rows, sym=sym, peers=peers,
        stage=None, handle=handle,
        comm=torch.cuda.Stream(device=device),
    )
    _WORKSPACES[key] = ws
    log.info("minimax: gemm_rs workspace %s x %s x %s %s on group %s (%.1f MiB symmetric)",
             world, rows, n, dtype, group_name, sym.numel() * sym.element_size() / 2**20)
    return ws


def prepare(tokens: int, n: int, dtype: torch.dtype, group_name: str, device=None) -> None:
    """Allocate the workspace for `tokens` rows (padded up to the group size) before CUDA-graph capture.

    Collective: every rank of the group must call it with the same arguments."""
    world = _resolve_group(group_name).size()
    rows = -(-tokens // world)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    _workspace(rows, n, dtype, group_name, device)


def fused_available(group_name: str) -> bool:
    """Whether the symmetric-memory path can run on this group (checked once per group)."""
    ok = _FUSED_OK.get(group_name)
    if ok is not None:
        return ok
    why = None
    if not kernel_options().gemm_rs_fused:
        why = "MINIMAX_GEMM_RS_FUSED=0 (kernel option gemm_rs_fused)"
    elif not torch.cuda.is_available():
        why = "no CUDA"
    else:
        try:
            # `from` form: a plain `import torch.x` here would make `torch` local to this function.
            from torch.distributed import _symmetric_memory  # noqa: F401
            from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401

            _resolve_group(group_name)
        except Exception as e:  # noqa: BLE001 - any failure means: use the plain path
            why = f"{type(e).__name__}: {e}"
    ok = why is None
    if not ok:
        warnings.warn(f"minimax::gemm_rs: fused path unavailable ({why}); using matmul + reduce-scatter", stacklevel=2)
    _FUSED_OK[group_name] = ok
    return ok


# ------------------------------------------------------------------- the op
class _RowsGemm:
    """gemm(lo, hi, out, add=None): out[:hi-lo] = x[lo:hi] @ weight.T (+ bias) (+ add[:hi-lo]);
    the padding rows of out are 0 (+ add's).

    Every GEMM writes its rows in place (cuBLAS `out=`), so a row block costs no extra copy;
    `add` goes into the GEMM's epilogue where cuBLASLt takes it (kernels/cublaslt_gemm.py)."""

    def __init__(self, x, weight, x_scale, weight_scale, bias, out_dtype):
        self.x, self.weight, self.x_scale, self.weight_scale = x, weight, x_scale, weight_scale
        self.bias, self.out_dtype = bias, out_dtype
        self._laid_out: dict[tuple[int, int], torch.Tensor] = {}  # (lo, hi) -> x_scale[lo:hi], M-major
        self.scale_transposes = 0  # GEMMs that transposed their own scales (for tests)

    def lay_out_scales(self, length: Optional[int]) -> None:
        """FP8: transpose the activation scales of every run of `length` rows in one kernel.

        cuBLAS takes each GEMM's scales M-major ([K/128, rows] contiguous). Transposed per
        GEMM, that is one small kernel on the main stream before each GEMM (four per call
        with two pieces on two ranks), in the gaps the overlap cannot hide."""
        if self.x_scale is None or not length or self.x_scale.shape[0] % length:
            return
        runs, groups = self.x_scale.shape[0] // length, self.x_scale.shape[1]
        laid = self.x_scale.float().reshape(runs, length, groups).transpose(1, 2).contiguous()
        self._laid_out = {(i * length, (i + 1) * length): laid[i].t() for i in range(runs)}

    def _scales(self, lo: int, hi: int) -> Optional[torch.Tensor]:
        if self.x_scale is None:
            return None
        laid = self._laid_out.get((lo, hi))
        if laid is None:
            self.scale_transposes += 1
            return self.x_scale[lo:hi]
        return laid  # [rows, K/128] with strides (1, rows): the GEMMs' .t().contiguous() is free

    def __call__(self, lo: int, hi: int, out: torch.Tensor, add: Optional[torch.Tensor] = None) -> None:
        real = max(0, hi - lo)
        if real:
            dst = out[:real]
            rows_scale = self._scales(lo, hi)
            fused = (add is not None and self.bias is None and self.x.is_cuda
                     and try_matmul_add(self.x[lo:hi], self.weight, add[:real], dst, rows_scale, self.weight_scale))
            if not fused:
                _plain_gemm(self.x[lo:hi], self.weight, rows_scale, self.weight_scale, self.bias, self.out_dtype, dst)
                if add is not None:
                    dst.add_(add[:real])
        if real < out.shape[0]:
            if add is None:
                out[real:].zero_()
            else:
                out[real:].copy_(add[real:])


def equal_runs(tokens: int, world: int, rows: int, pieces: list[tuple[int, int]]) -> Optional[int]:
    """The common length of every GEMM's rows when they cut x into equal runs (no padding
    rows, pieces of one length), else None: then _RowsGemm.lay_out_scales applies."""
    lengths = {b - a for a, b in pieces}
    return lengths.pop() if len(lengths) == 1 and tokens == rows * world else None


def _plain_gemm(x, weight, x_scale, weight_scale, bias, out_dtype, dst) -> None:
    if x_scale is None and bias is None:
        torch.mm(x, weight.t(), out=dst)
    elif x_scale is None:
        torch.addmm(bias.reshape(-1), x, weight.t(), out=dst)
    elif x.is_cuda:
        fp8_block_gemm_cuda(x, x_scale, weight, weight_scale, out_dtype, out=dst)
        if bias is not None:
            dst.add_(bias.reshape(-1).to(dst.dtype))
    else:
        dst.copy_(local_gemm(x, weight, x_scale, weight_scale, bias, out_dtype))


def choose_schedule(tokens: int, k: int, fp8: bool = False) -> str:
    """'epilogue' or 'sum_after' for a GEMM of `tokens` (padded) rows over K = k.

    sum_after: the own rows' GEMM runs beside the last push and a sum over the slots
    follows the last barrier. epilogue: the own rows wait, piece by piece, for the
    peer's partials and add them in the GEMM's epilogue. The sum costs a pass over
    [m, N] after everything; the epilogue costs fixed latency (barriers, smaller GEMMs)
    and needs each piece's GEMM to outlast the push of the piece before, which depends
    on the GEMM's time per row, i.e. K (FP8 counts as FP8_K_FACTOR x K).

    The rule: epilogue from M' x K_eff >= EPILOGUE_MIN_WORK with K_eff >= EPILOGUE_MIN_K
    (below, a piece's FP8 GEMM is shorter than the push before it), the crossover
    measured on 2 x H200 at N = 6144 (measured: docs/kernel-notes.md#gemm-rs-schedule)."""
    forced = kernel_options().gemm_rs_schedule
    if forced != "auto":
        return forced
    k_eff = k * FP8_K_FACTOR if fp8 else k
    return "epilogue" if k_eff >= EPILOGUE_MIN_K and tokens * k_eff >= EPILOGUE_MIN_WORK else "sum_after"


def push_pieces(rows: int, k: int, schedule: str = "epilogue") -> int:
    """How many pieces each block of `rows` rows (a GEMM over K = k) is computed in.

    epilogue: the own rows wait for the peer's push of the same piece, so one piece would
    put the whole push between the two halves of the GEMM; two let each push run beside
    the next piece's GEMM (3 and 4 were no faster). sum_after: two pieces at K <= 2048
    only, where the push (rows x N x 2 bytes, whatever K is) can outlast the own-rows GEMM
    that hides it; one above (each piece's GEMM is a little less efficient). Pieces have
    >= MIN_PIECE_ROWS rows (measured: docs/kernel-notes.md#gemm-rs-pieces)."""
    forced = kernel_options().gemm_rs_pieces
    if forced is not None:
        return min(forced, max(1, rows // PIECE_ALIGN))
    if schedule == "sum_after" and k > SMALL_K:
        return 1
    return max(1, min(DEFAULT_PIECES, rows // MIN_PIECE_ROWS))


def piece_bounds(rows: int, pieces: int) -> list[tuple[int, int]]:
    """[(start, end)] of `pieces` near-equal runs of rows, boundaries on multiples of PIECE_ALIGN."""
    cuts = [0] + [min(rows, round(rows * i / pieces / PIECE_ALIGN) * PIECE_ALIGN) for i in range(1, pieces)] + [rows]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def push_mode() -> str:
    """'copy': GEMM into a local stage, the copy engine pushes it; 'store': the GEMM writes
    the peer's slot itself, over NVLink (no stage, no copy engine, but the main stream waits
    for the start barrier). store is slower nearly everywhere on 2 x H200: cuBLAS's epilogue
    stores to NVLink hold the GEMM up (measured: docs/kernel-notes.md#gemm-rs-push). Kept
    as the option to re-measure on other NVLink generations."""
    return kernel_options().gemm_rs_push


def push_partials(ws: _Workspace, gemm: _RowsGemm, tokens: int, pieces: list[tuple[int, int]],
                  mark_pieces: bool, store: bool = False) -> None:
    """Compute every peer's rows and send them, piece by piece, to the owner's slot [my rank].

    With mark_pieces, a barrier on the side stream after each piece: when it passes, that
    piece of every peer's partial sums has landed in my slots (ws.arrived[p]). With store,
    the GEMM writes straight into the peer's slot (the caller has joined the start barrier)."""
    ws.pushes = []
    if not store and ws.stage is None:
        ws.stage = torch.empty_like(ws.sym)
    for p, (a, b) in enumerate(pieces):
        for step in range(1, ws.world):
            d = (ws.rank + step) % ws.world
            lo = d * ws.rows
            if store:
                gemm(lo + a, min(lo + b, tokens), ws.peers[d][ws.rank, a:b])
            else:
                gemm(lo + a, min(lo + b, tokens), ws.stage[d, a:b])
                ws.fork()
                with ws.side():
                    ws.peers[d][ws.rank, a:b].copy_(ws.stage[d, a:b], non_blocking=True)
            ws.pushes.append((d, ws.rank, a, b))
        if mark_pieces:
            ws.fork()  # after this piece's GEMMs (the stores) and copies
            with ws.side():
                ws.barrier()
                ws.mark_arrived(p)


def own_rows_sum_after(ws: _Workspace, gemm: _RowsGemm, tokens: int) -> torch.Tensor:
    """sum_after: GEMM my rows into my slot beside the last push; after the barrier, sum the W slots.

    Summing each piece on the side stream beside the next GEMM was slower: the sum does not
    run beside cuBLAS's GEMM (measured: docs/kernel-notes.md#gemm-rs-sum-overlap)."""
    lo = ws.rank * ws.rows
    gemm(lo, min(lo + ws.rows, tokens), ws.sym[ws.rank])
    ws.join()
    ws.barrier()  # every peer's copies into my slots are complete
    if ws.world == 2:
        return torch.add(ws.sym[0], ws.sym[1])
    return ws.sym.sum(dim=0)  # fp32 accumulation, one rounding


def own_rows_epilogue(ws: _Workspace, gemm: _RowsGemm, tokens: int, pieces: list[tuple[int, int]],
                      out: torch.Tensor) -> torch.Tensor:
    """epilogue: out = my rows of the sum over ranks, piece by piece as the peers' partials arrive.

    Two ranks: the peer's slot is the addend of my GEMM (added in its epilogue by cuBLASLt,
    or right after it where cuBLASLt declines). More: my partial goes to my own slot and
    the W slots are summed (fp32 accumulation, one rounding)."""
    lo = ws.rank * ws.rows
    for p, (a, b) in enumerate(pieces):
        hi = min(lo + b, tokens)
        if ws.world == 2:
            ws.wait_arrived(p)
            gemm(lo + a, hi, out[a:b], add=ws.sym[1 - ws.rank, a:b])
        else:
            gemm(lo + a, hi, ws.sym[ws.rank, a:b])
            ws.wait_arrived(p)
            torch.sum(ws.sym[:, a:b], dim=0, out=out[a:b])
    ws.join()
    return out


def run_schedule(ws: _Workspace, gemm: _RowsGemm, tokens: int, k: int, fp8: bool, n: int, dtype, device) -> torch.Tensor:
    """Everything after the start barrier (which runs on the side stream)."""
    schedule = choose_schedule(ws.rows * ws.world, k, fp8)
    pieces = piece_bounds(ws.rows, push_pieces(ws.rows, k, schedule))
    store = push_mode() == "store"
    said = (ws.rows, k, fp8, schedule, len(pieces), store)
    if said not in _SAID:  # once per shape and choice: what the op does at run time
        _SAID.add(said)
        log.info("minimax: gemm_rs %d rows x K=%d %s on %d ranks: %s schedule, %d piece(s), %s push", ws.rows * ws.world,
                 k, "FP8" if fp8 else str(dtype).replace("torch.", ""), ws.world, schedule, len(pieces),
                 "GEMM-store" if store else "copy-engine")
    gemm.lay_out_scales(equal_runs(tokens, ws.world, ws.rows, pieces))
    if store:  # the GEMMs write the peers' slots: only once every peer has finished reading them
        ws.join()
    push_partials(ws, gemm, tokens, pieces, mark_pieces=schedule == "epilogue", store=store)
    if schedule == "sum_after":
        return own_rows_sum_after(ws, gemm, tokens)
    return own_rows_epilogue(ws, gemm, tokens, pieces, torch.empty((ws.rows, n), dtype=dtype, device=device))


def gemm_rs_fused(x, weight, x_scale, weight_scale, bias, pad_rows: int, group_size: int, group_name: str,
                  out_dtype=None) -> torch.Tensor:
    tokens, n = x.shape[0], weight.shape[0]
    rows = (tokens + pad_rows) // group_size
    dtype = out_dtype or x.dtype
    ws = _workspace(rows, n, dtype, group_name, x.device)
    if ws.world != group_size:
        raise RuntimeError(f"minimax::gemm_rs: group {group_name!r} has {ws.world} ranks, the op says {group_size}")
    gemm = _RowsGemm(x, weight, x_scale, weight_scale, bias, dtype)
    # Before the first push, every rank must be done reading its slots (the
    # previous call's own-rows GEMMs and sums). That barrier runs on the side
    # stream, after it waits for our own earlier work, so the first GEMM need
    # not wait for the slowest rank: the GEMMs only write local memory.
    ws.fork()
    with ws.side():
        ws.barrier()
    return run_schedule(ws, gemm, tokens, x.shape[1], x_scale is not None, n, dtype, x.device)


@gemm_rs.register_kernel("cuda")
def _gemm_rs_cuda(x, weight, x_scale, weight_scale, bias, pad_rows, min_tokens, group_size, group_name,
                  out_dtype=None):
    check_args(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, out_dtype)
    if x.is_cuda and group_size > 1 and x.shape[0] >= min_tokens and fused_available(group_name):
        return gemm_rs_fused(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, group_name, out_dtype)
    return gemm_rs_reference(x, weight, x_scale, weight_scale, bias, pad_rows, group_size, group_name, out_dtype)
