"""The kernel switches, declared once: `KernelOptions`.

Each switch picks between kernel paths that compute the same op (a faster
default and the path it replaced, kept to measure against), or pins a choice
the kernels otherwise make by shape. None of them changes the graph, so they
are not part of the backend config; they are part of what a compile ran with
(`kernel_options().to_dict()`, `stable_hash()`).

A CUDA graph holds the kernels its capture chose: a compiled model called under
other switches captures a graph of its own (graph_passes/cudagraph_capture.py), so
an override reaches a model that was compiled and captured before it.

They are read from the environment ONCE, on the first `kernel_options()` call
of the process, and validated then: a bad value is a ValueError that names the
variable and the values it takes. Benchmarks and tests change them with
`override_kernel_options(**changes)`, never by setting os.environ mid-process
(which has no effect after the first read). Spawned ranks read their own
environment, so a launcher sets the variables before it starts them.

| option           | variable                 | default | values                           | what it does |
|------------------|--------------------------|---------|----------------------------------|--------------|
| moe_kernel       | MINIMAX_MOE_KERNEL       | triton  | triton, reference                | reference: the plain-torch experts on CUDA instead of the Triton grouped GEMMs |
| moe_tiles        | MINIMAX_MOE_TILES        | (unset) | BM,BN,BK,warps,stages[,BN_DOWN[,down_warps,down_stages]] | the grouped GEMMs' tiles instead of tile_config's choice by token count |
| moe_gate_up      | MINIMAX_MOE_GATE_UP      | auto    | auto, two_dots, one_dot          | the gate/up kernel's product per K step instead of tile_config's choice (auto: one product twice as wide at prefill sizes, two products at decode sizes) |
| moe_group_m      | MINIMAX_MOE_GROUP_M      | (unset) | a whole number >= 0              | the grouped GEMMs' program order instead of tile_config's choice: 0 = row blocks fastest over all, g = groups of g row blocks, each group's column tiles first |
| moe_expert_groups | MINIMAX_MOE_EXPERT_GROUPS | (unset) | a whole number >= 1             | the grouped GEMMs' program order by expert: each group one expert's row blocks (at most this many), its column tiles first; overrides moe_group_m (kernels/moe_expert_groups.py) |
| moe_gemm         | MINIMAX_MOE_GEMM         | auto    | auto, triton, gluon, gluon192    | the expert GEMMs at prefill sizes: auto = the warp-specialized Gluon FP8 gate/up of kernels/moe_gluon.py where the GPU runs it (sm_90), in its 192-row form from 128 rows per expert, else Triton; BF16: the 192-row Gluon gate/up and down from 256 rows per expert, else Triton; gluon = the 64-row FP8 kernel or an error (BF16: Triton); gluon192 = the 192-row form (three 64-row groups share each weight tile; in BF16 too, gate/up and down) or an error; triton = the Triton loops |
| moe_down         | MINIMAX_MOE_DOWN         | auto    | auto, triton                     | the down GEMM: auto = the warp-specialized Gluon kernel of kernels/moe_gluon.py wherever the gate/up runs over 192-row blocks, else Triton; triton = the Triton kernel always (and a BF16 layer wholly on Triton) |
| moe_trio_rows    | MINIMAX_MOE_TRIO_ROWS    | live    | live, all                        | the 192-row Gluon GEMMs' producer: live = only the 64-row tiles of groups that hold rows (an idle group's tile is padding nobody reads: 3-13% fewer bytes a stage at M3's prefill sizes); all = every 64-row tile of a block into each stage |
| moe_bf16_passes  | MINIMAX_MOE_BF16_PASSES  | 1       | 1, 2                             | the BF16 192-row Gluon gate/up: 2 = two passes over a program's K steps, 64 columns of h each, the block's activation tiles loaded in both; 1 = one pass, a gate and an up product side by side from 256-row weight tiles, the activation tiles loaded once, and the BF16 Gluon down two column tiles a pass (8-13% faster than 2 on an H100) |
| moe_fp8_yield    | MINIMAX_MOE_FP8_YIELD    | off     | off, 1, 2, 4                     | n: the FP8 192-row Gluon gate/up and down with the yield hint on every n-th FFMA of their promotion runs (kernels/ffma_yield.py edits the compiled cubin before it loads; the same results bit for bit), so the other warp groups issue their products during a group's scaling; off: as ptxas emits them |
| moe_half_blocks  | MINIMAX_MOE_HALF_BLOCKS  | auto    | auto, off, on                    | on: the Triton grouped GEMMs multiply only the first half of a block whose second half is padding (an expert's run ends in its last block: at M3's 4096 tokens BF16 at BLOCK_M 128 multiplies 38% more rows than the useful ones, 19% with halves); auto: on for BF16 at BLOCK_M 128 where the experts average at most a block of rows (M3 up to 4096 tokens), where it was measured faster |
| moe_align        | MINIMAX_MOE_ALIGN        | triton  | triton, torch                    | torch: the experts' sorted layout from ~15-40 torch kernels instead of Triton (one program up to 512 token-expert pairs, chunks of pairs in two launches past them) |
| moe_route        | MINIMAX_MOE_ROUTE        | triton  | triton, torch                    | torch: the router's selection op for op instead of one Triton kernel |
| moe_select       | MINIMAX_MOE_SELECT       | fused   | fused, separate                  | fused: at decode sizes the router's logits launch also quantizes x for the expert GEMMs, and the selection, the shared expert's slot and the alignment run in one launch; separate: a quantization kernel, the selection kernel, two torch.cat and the alignment kernel |
| moe_overlap      | MINIMAX_MOE_OVERLAP      | auto    | auto, off                        | auto: on sm_90 and later the decode MoE's launches (logits, selection + alignment, gate/up, down, combine) are programmatic dependent launches, each scheduled while the one before finishes (kernels/launch_overlap.py); off: plain launches |
| moe_router_logits | MINIMAX_MOE_ROUTER_LOGITS | auto  | auto, cublas                     | the router's float32 logits above decode sizes: auto = three bf16 tensor-core products of bf16 rows (the weight split exactly into bf16 parts), cublas = cuBLAS on the rows cast to float32 |
| moe_shared       | MINIMAX_MOE_SHARED       | merged  | merged, separate                 | separate: the shared expert in its own launches instead of inside the routed ones |
| gemm_rs_fused    | MINIMAX_GEMM_RS_FUSED    | 1       | 1, 0                             | 0: every GEMM + reduce-scatter as matmul + NCCL, never the overlapped kernel |
| gemm_rs_schedule | MINIMAX_GEMM_RS_SCHEDULE | auto    | auto, epilogue, sum_after        | how the own rows are reduced (auto: by GEMM size, choose_schedule) |
| gemm_rs_push     | MINIMAX_GEMM_RS_PUSH     | copy    | copy, store                      | store: the GEMMs write the peers' buffers over NVLink instead of the copy engine pushing a local copy |
| gemm_rs_pieces   | MINIMAX_GEMM_RS_PIECES   | (unset) | a whole number >= 1              | pieces per row block instead of push_pieces' rule (2, or 1 for sum_after above K = 2048) |
| fp8_gemm         | MINIMAX_FP8_GEMM         | auto    | auto, scaled_mm, triton          | the FP8 block GEMM's backend (auto: the small-M kernel up to 16 rows, cuBLAS blockwise where trusted, else Triton) |
| allreduce_norm   | MINIMAX_ALLREDUCE_NORM   | unfused | unfused, symm_mem                | symm_mem: allreduce_rms_norm_quant as one kernel over symmetric memory (not yet run on GPUs) instead of NCCL all-reduce + the norm kernel |

The non-default values are the slower paths kept to compare against, or pin
what the kernels choose by shape (figures: docs/measurements/2026-11-30.md,
"MoE layer" and "GEMM + reduce-scatter"; the rules they back:
docs/kernel-notes.md). Who runs them:

* moe_align / moe_route / moe_shared / moe_select / moe_overlap = the non-default value: the MoE GPU tests
  and the interpreter tests of tests/test_moe_triton.py, each one;
* gemm_rs_schedule and gemm_rs_push: both values in the CPU schedule test
  (tests/test_gemm_rs_kernel.py) and the 2-GPU tests; gemm_rs_pieces 1, 2, 3
  and 16 in the CPU schedule test; tools/bench_gemm_rs.py times them
  (--schedules, --push, --pieces). Both are read when a call runs, i.e. when
  it is captured into a CUDA graph, not at replay;
* gemm_rs_push=store was slower on the H200 (NVLink 4) and is kept to
  re-measure on other NVLink generations;
* fp8_gemm: the GPU tests run both backends; moe_tiles: to try tiles by hand
  (set it for a run of tools/profile_moe.py or tools/bench_moe.py);
* moe_gate_up and moe_group_m pin what tile_config's table picks by token
  count (one product and grouped program order at prefill sizes, measured
  8-16% faster on the H200: docs/kernel-notes.md#moe-tiles); the interpreter
  and GPU tests of tests/test_moe_triton.py run the values the table does not
  pick, tools/tune_moe.py --gate-up / --group-m sweep them;
* moe_expert_groups: pins the cap of the order by expert, which tile_config's table picks
  for FP8 at prefill sizes (at most 8 blocks; 1-4% faster than groups of 4 back to back on the
  H200: docs/kernel-notes.md#moe-at-the-power-limit), and sets it where the table does not; the
  interpreter tests of tests/test_moe_triton.py check that it computes the same bits as the
  other orders, tools/tune_moe.py --expert-groups sweeps it;
* moe_gemm: auto (the default since 2026-12-03, twelfth session) runs the warp-specialized
  Gluon gate/up kernel on sm_90, which equals the Triton one bit for bit; the layer with it was
  1.6-4.4% faster at 8192-16384 tokens (burst and back to back at the card's power limit) and
  even end to end at prefill 8192 (docs/measurements/2026-12-03.md, eleventh session), and the
  GPU suite passed with it as the default (twelfth session). triton is the loop it replaced;
  gluon makes a GPU without it an error. The GPU tests of tests/test_moe_triton.py run all
  three, tools/tune_moe.py --moe-gemm times them, tools/bench_e2e.py --variants
  minimax-moe-triton / minimax-moe-gluon run the model with them. Since 2026-12-04 (fifteenth
  session) auto runs the gate/up over 192-row blocks from 256 rows per expert (gluon192 pins
  it): the layer 2-6% faster at 8192-16384 tokens, the GPU tests passing with it; since
  2026-12-06 (twenty-second session) from 128 rows per expert (4096 tokens at EP 1: the layer
  3-6% faster on an H100; docs/kernel-notes.md#three-warp-groups-over-192-row-blocks). gluon192
  also runs a BF16 layer's gate/up and down in Gluon (bit-equal to Triton; in two passes 3-4%
  slower on an H100: docs/kernel-notes.md#moe-bf16-in-gluon); since 2026-12-08 (thirty-fifth
  session) auto runs them from 256 rows per expert, in one pass (moe_bf16_passes): the layer
  8-9% faster than Triton at 8192 tokens, 12-15% at 16384, even at 4096 (one H100);
* moe_down: auto (the default since 2026-12-04) runs the Gluon down GEMM over the same 192-row
  blocks wherever the gate/up runs in that form: bit-equal to the Triton down (GPU tests), 12%
  faster than it at 8192 tokens and even at 16384, the layer back to back 1-2% faster
  (docs/kernel-notes.md#the-down-gemm-over-the-same-blocks); triton keeps the Triton kernel,
  tools/tune_moe.py --moe-down and bench_e2e's minimax-moe-triton-down compare the two;
* moe_trio_rows: live (the default since 2026-12-07, twenty-seventh session) skips the idle groups'
  row loads in the 192-row Gluon GEMMs: bit-equal to all (GPU tests of tests/test_moe_triton.py,
  over blocks with one and two live groups), the layer 1-2% faster at 4096-16384 tokens on an
  H100 (docs/kernel-notes.md#idle-row-loads-skipped); all keeps every row load,
  tools/tune_moe.py --trio-rows all live times both forms;
* moe_bf16_passes: 1 (built 2026-12-07, the default since 2026-12-08, thirty-fifth session)
  halves the activation bytes the BF16 192-row gate/up and down load per FLOP
  (docs/kernel-notes.md#the-bf16-gateup-in-one-pass); the GPU test of tests/test_moe_triton.py
  checks it against the Triton path bit for bit (passed on an H100), tools/tune_moe.py
  --bf16-passes 2 1 times both: one pass 6-11% faster per call than two at 4096-16384 tokens;
* moe_fp8_yield: built 2026-12-08 (thirty-sixth session) against the FP8 scaling's issue cost
  (docs/kernel-notes.md#yield-hints-on-the-fp8-promotion); not yet timed on a GPU, so off. The
  CPU tests check the edit against the disassembly, the GPU test of tests/test_moe_triton.py checks
  the layer's bits equal to off's, tools/tune_moe.py --fp8-yield off 1 2 4 times them;
* moe_half_blocks: on (2026-12-07, twenty-seventh session) gives the Triton gate/up and down
  kernels a second copy of their loop at half the block's rows, taken where the block's second
  half is padding (docs/kernel-notes.md#moe-against-both-limits counts the padding); auto (the
  default since the twenty-eighth session) takes it for BF16 at BLOCK_M 128 where the experts
  average at most one block of rows (moe_plan.half_blocks_fit): on an H100 the BF16 layer at 4096
  tokens 2.8-4.4% faster per call and 1.4-1.8% back to back, mixed at 8192, 2.5-4.3% slower at
  16384; FP8 at 2048 tokens (BLOCK_M 64) 3% slower (docs/kernel-notes.md#half-blocks-measured).
  The GPU tests of tests/test_moe_triton.py ran with it on at every switch case (the same bits).
* moe_align: triton takes the chunked alignment past 1024 pairs since 2026-12-04 (seventeenth
  session; kernels/moe_align_triton.py:align_with_triton), past 512 since 2026-12-05: on one H200 5.9-25 us a layer at
  2560-81920 pairs against the torch sort's 119-179 us and the one program's 48-50 us at
  2560-4095 pairs, the same tensors on the GPU at every chunk size
  (docs/kernel-notes.md#moe-alignment); before, the one program took up to 4096 pairs and the
  torch sort the rest;
* moe_router_logits: auto (the default since 2026-12-04, sixteenth session) computes the
  logits of bf16 rows above LOGITS_MAX_TOKENS as three bf16 products of the exactly split
  float32 weight (kernels/moe_route_triton.py): 1.2x faster than cuBLAS at 17 rows, 4.7-6.1x at
  4096-16384, closer to float64, 1.1 ms of an 8k prefill's device time on the H200
  (docs/kernel-notes.md#router-logits-at-prefill); cublas is the cast + float32 GEMM it replaced.
  The interpreter and GPU tests of tests/test_moe_triton.py compare both with a float64
  product, tools/bench_router.py times them;
* allreduce_norm=symm_mem: the fused kernel's math runs in the CPU interpreter
  tests (tests/test_allreduce_norm_kernel.py); the symmetric-memory part needs
  several GPUs and has not run yet, so it is not the default.

tests/test_kernel_options.py checks this table against the declarations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

__all__ = ["KernelOptions", "kernel_options", "override_kernel_options"]


def _switch(env: str, default, doc: str, choices: Optional[tuple[str, ...]] = None, kind: str = "choice",
            allowed: str = ""):
    """A dataclass field that is one switch: its variable, default, values and one-line doc."""
    return field(default=default, metadata={"env": env, "doc": doc, "choices": choices, "kind": kind,
                                            "allowed": allowed or ", ".join(choices or ())})


_TILES_HELP = ("expected five, six or eight integers BM,BN,BK,warps,stages[,BN_DOWN[,down_warps,down_stages]] "
               "(e.g. 64,128,64,4,3)")


@dataclass(frozen=True)
class KernelOptions:
    """One value per kernel switch (see the module docstring's table). Values are checked
    (and strings from the environment parsed) when an instance is made."""

    moe_kernel: str = _switch(
        "MINIMAX_MOE_KERNEL", "triton", "reference: the plain-torch experts on CUDA instead of the Triton grouped GEMMs",
        choices=("triton", "reference"))
    moe_tiles: Optional[tuple[int, ...]] = _switch(
        "MINIMAX_MOE_TILES", None, "the grouped GEMMs' tiles instead of tile_config's choice by token count",
        kind="tiles", allowed="BM,BN,BK,warps,stages[,BN_DOWN[,down_warps,down_stages]]")
    moe_gate_up: str = _switch(
        "MINIMAX_MOE_GATE_UP", "auto", "the gate/up kernel's product per K step instead of tile_config's choice "
        "(auto: one product twice as wide at prefill sizes, two products at decode sizes)",
        choices=("auto", "two_dots", "one_dot"))
    moe_group_m: Optional[int] = _switch(
        "MINIMAX_MOE_GROUP_M", None, "the grouped GEMMs' program order instead of tile_config's choice: 0 = row "
        "blocks fastest over all, g = groups of g row blocks, each group's column tiles first", kind="order",
        allowed="a whole number >= 0")
    moe_expert_groups: Optional[int] = _switch(
        "MINIMAX_MOE_EXPERT_GROUPS", None, "the grouped GEMMs' program order by expert: each group one expert's row "
        "blocks (at most this many), its column tiles first; overrides moe_group_m (kernels/moe_expert_groups.py)",
        kind="count", allowed="a whole number >= 1")
    moe_gemm: str = _switch(
        "MINIMAX_MOE_GEMM", "auto", "the expert GEMMs at prefill sizes: auto = the warp-specialized Gluon FP8 "
        "gate/up of kernels/moe_gluon.py where the GPU runs it (sm_90), in its 192-row form from 128 rows per "
        "expert, else Triton (BF16: the 192-row Gluon gate/up and down from 256 rows per expert); gluon = the "
        "64-row FP8 kernel or an error (BF16 stays on Triton); "
        "gluon192 = the 192-row form (three 64-row groups share each weight tile; in BF16 too, gate/up and down) "
        "or an error; triton = the Triton loops", choices=("auto", "triton", "gluon", "gluon192"))
    moe_down: str = _switch(
        "MINIMAX_MOE_DOWN", "auto", "the down GEMM: auto = the warp-specialized Gluon kernel of "
        "kernels/moe_gluon.py wherever the gate/up runs over 192-row blocks, else Triton; triton = the Triton "
        "kernel always (and a BF16 layer wholly on Triton)", choices=("auto", "triton"))
    moe_trio_rows: str = _switch(
        "MINIMAX_MOE_TRIO_ROWS", "live", "the 192-row Gluon GEMMs' producer: live = only the 64-row tiles of "
        "groups that hold rows; all = every 64-row tile of a block into each stage", choices=("live", "all"))
    moe_bf16_passes: str = _switch(
        "MINIMAX_MOE_BF16_PASSES", "1", "the BF16 192-row Gluon gate/up: 2 = two passes of 64 columns of h, the "
        "activation tiles loaded in both; 1 = one pass over all 128 columns from 256-row weight tiles, the "
        "activation tiles loaded once, and the BF16 Gluon down two column tiles a pass", choices=("1", "2"))
    moe_fp8_yield: str = _switch(
        "MINIMAX_MOE_FP8_YIELD", "off", "n: the FP8 192-row Gluon gate/up and down with the yield hint on every "
        "n-th FFMA of their promotion runs (the compiled cubin edited before it loads; the same results); off: as "
        "ptxas emits them", choices=("off", "1", "2", "4"))
    moe_half_blocks: str = _switch(
        "MINIMAX_MOE_HALF_BLOCKS", "auto", "on: the Triton grouped GEMMs multiply only the first half of a block "
        "whose second half is padding; auto: on for BF16 at BLOCK_M 128 where the experts average at most a block "
        "of rows (measured faster there only)", choices=("auto", "off", "on"))
    moe_align: str = _switch(
        "MINIMAX_MOE_ALIGN", "triton", "torch: the experts' sorted layout from ~15-40 torch kernels instead of "
        "Triton (one program up to 512 token-expert pairs, chunks of pairs in two launches past them)",
        choices=("triton", "torch"))
    moe_route: str = _switch(
        "MINIMAX_MOE_ROUTE", "triton", "torch: the router's selection op for op instead of one Triton kernel",
        choices=("triton", "torch"))
    moe_select: str = _switch(
        "MINIMAX_MOE_SELECT", "fused", "fused: at decode sizes the router's logits launch also quantizes x for the "
        "expert GEMMs, and the selection, the shared expert's slot and the alignment run in one launch; separate: "
        "a quantization kernel, the selection kernel, two torch.cat and the alignment kernel",
        choices=("fused", "separate"))
    moe_overlap: str = _switch(
        "MINIMAX_MOE_OVERLAP", "auto", "auto: on sm_90 and later the decode MoE's launches (logits, selection + "
        "alignment, gate/up, down, combine) are programmatic dependent launches, each scheduled while the one before "
        "finishes; off: plain launches", choices=("auto", "off"))
    moe_router_logits: str = _switch(
        "MINIMAX_MOE_ROUTER_LOGITS", "auto", "the router's float32 logits above decode sizes: auto = three bf16 "
        "tensor-core products of bf16 rows (the weight split exactly into bf16 parts), cublas = cuBLAS on the rows "
        "cast to float32", choices=("auto", "cublas"))
    moe_shared: str = _switch(
        "MINIMAX_MOE_SHARED", "merged", "separate: the shared expert in its own launches instead of inside the "
        "routed ones", choices=("merged", "separate"))
    gemm_rs_fused: bool = _switch(
        "MINIMAX_GEMM_RS_FUSED", True, "0: every GEMM + reduce-scatter as matmul + NCCL", kind="flag",
        allowed="1, 0")
    gemm_rs_schedule: str = _switch(
        "MINIMAX_GEMM_RS_SCHEDULE", "auto", "how the own rows are reduced (auto: by GEMM size)",
        choices=("auto", "epilogue", "sum_after"))
    gemm_rs_push: str = _switch(
        "MINIMAX_GEMM_RS_PUSH", "copy", "store: the GEMMs write the peers' buffers instead of the copy engine",
        choices=("copy", "store"))
    gemm_rs_pieces: Optional[int] = _switch(
        "MINIMAX_GEMM_RS_PIECES", None, "pieces per row block instead of push_pieces' rule", kind="count",
        allowed="a whole number >= 1")
    fp8_gemm: str = _switch(
        "MINIMAX_FP8_GEMM", "auto", "the FP8 block GEMM's backend (auto: the small-M kernel up to 16 rows, cuBLAS "
        "blockwise where trusted, else Triton)",
        choices=("auto", "scaled_mm", "triton"))
    allreduce_norm: str = _switch(
        "MINIMAX_ALLREDUCE_NORM", "unfused", "symm_mem: allreduce_rms_norm_quant as one kernel over symmetric "
        "memory (not yet run on GPUs) instead of NCCL all-reduce + the norm kernel", choices=("unfused", "symm_mem"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check(f, getattr(self, f.name)))

    # ------------------------------------------------------------ reading
    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "KernelOptions":
        """The options the variables in `environ` (default os.environ) set; unset ones keep their defaults."""
        environ = os.environ if environ is None else environ
        return cls(**{f.name: environ[f.metadata["env"]] for f in dataclasses.fields(cls)
                      if f.metadata["env"] in environ})

    @classmethod
    def switches(cls) -> list[dict]:
        """The declarations: [{option, variable, default, values, doc}] in table order."""
        return [{"option": f.name, "variable": f.metadata["env"], "default": _env_text(f, f.default),
                 "values": f.metadata["allowed"], "doc": f.metadata["doc"]} for f in dataclasses.fields(cls)]

    # ------------------------------------------------------------ reporting
    def to_dict(self) -> dict:
        """{option: value}, JSON-ready (tiles as a list, unset as None)."""
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    def changed(self) -> dict:
        """The options that differ from their defaults, as to_dict gives them."""
        default = KernelOptions().to_dict()
        return {k: v for k, v in self.to_dict().items() if v != default[k]}

    def stable_hash(self) -> str:
        """16 hex digits of a SHA-256 of to_dict(): equal options give the same hash in any process."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _env_text(f: dataclasses.Field, value) -> str:
    """A value as the variable would spell it ("(unset)" for None)."""
    if value is None:
        return "(unset)"
    if f.metadata["kind"] == "flag":
        return "1" if value else "0"
    if f.metadata["kind"] == "tiles":
        return ",".join(str(v) for v in value)
    return str(value)


def _check(f: dataclasses.Field, value):
    """The value of switch f, parsed from its variable's spelling where it is a string."""
    env, kind, default = f.metadata["env"], f.metadata["kind"], f.default
    if kind == "choice":
        if value not in f.metadata["choices"]:
            raise ValueError(f"{env}={value!r}: use one of {f.metadata['allowed']} (default {default})")
        return value
    if kind == "flag":
        if isinstance(value, bool):
            return value
        if value in ("1", "0"):
            return value == "1"
        raise ValueError(f"{env}={value!r}: use one of 1, 0 (default {_env_text(f, default)})")
    if kind == "tiles":
        if value is None or value == "":  # an empty variable counts as unset
            return None
        try:
            vals = tuple(int(v) for v in (value.split(",") if isinstance(value, str) else value))
        except (TypeError, ValueError):
            vals = ()
        if len(vals) not in (5, 6, 8) or any(v <= 0 for v in vals):
            raise ValueError(f"{env}={value!r}: {_TILES_HELP}")
        return vals
    if kind in ("count", "order"):  # a count starts at 1; an order (moe_group_m) at 0
        if value is None:
            return None
        least = 1 if kind == "count" else 0
        number = int(value) if isinstance(value, str) and value.isdigit() else value
        if isinstance(number, bool) or not isinstance(number, int) or number < least:
            raise ValueError(f"{env}={value!r}: use a whole number >= {least}")
        return number
    raise AssertionError(kind)  # pragma: no cover


# ---------------------------------------------------------------- the process's options
_CURRENT: Optional[KernelOptions] = None
_LOCK = threading.Lock()


def kernel_options() -> KernelOptions:
    """The options in force: read from the environment on the first call, then cached
    (or what an enclosing override_kernel_options set)."""
    global _CURRENT
    opts = _CURRENT
    if opts is None:
        with _LOCK:
            if _CURRENT is None:
                _CURRENT = KernelOptions.from_env()  # a bad value raises here, and caches nothing
            opts = _CURRENT
    return opts


@contextlib.contextmanager
def override_kernel_options(**changes) -> Iterator[KernelOptions]:
    """Run a block with some switches changed (by option name; values as KernelOptions takes
    them, or as the variable spells them: moe_tiles="64,128,64,4,3", gemm_rs_pieces="3").

    Process-wide, not per thread; restores what was in force before on exit. Checked
    before it takes effect: an unknown name is a TypeError, a bad value a ValueError."""
    global _CURRENT
    names = {f.name for f in dataclasses.fields(KernelOptions)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"override_kernel_options: unknown option(s) {', '.join(unknown)}; "
                        f"the options are {', '.join(sorted(names))}")
    new = dataclasses.replace(kernel_options(), **changes)
    with _LOCK:
        before, _CURRENT = _CURRENT, new
    try:
        yield new
    finally:
        with _LOCK:
            _CURRENT = before
