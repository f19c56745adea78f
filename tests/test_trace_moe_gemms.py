"""tools/trace_moe_gemms.py and the 192-row FP8 GEMMs' TRACE builds (kernels/gluon_trace.py): the
records' reading on made-up timelines (CPU), its errors, and on an sm_90 GPU the traced kernels'
outputs and records."""

import pytest
import torch

from minimax_backend.kernels import gluon_trace
from minimax_backend.tools import trace_moe_gemms as tg

GHZ = 2.0  # cycles per ns of the made-up programs


def _record(sm, entry_ns, first_ready_ns, last_product_ns, end_ns, steps=48, groups=0b011, ready_waits=(0, 0, 0),
            empty_wait=0):
    """One program's record as the traced kernel writes it, its cycle counter at GHZ from 1000 cycles."""
    def cyc(t):
        return int(1000 + GHZ * (t - entry_ns))

    rec = [0] * gluon_trace.RECORD_SLOTS
    values = {"entry_ns": entry_ns, "end_ns": end_ns, "sm": sm, "entry_cycle": cyc(entry_ns),
              "first_ready_cycle": cyc(first_ready_ns), "last_product_cycle": cyc(last_product_ns),
              "end_cycle": cyc(end_ns), "ready_wait_0": ready_waits[0], "ready_wait_1": ready_waits[1],
              "ready_wait_2": ready_waits[2], "empty_wait": empty_wait, "producer_entry_cycle": cyc(entry_ns),
              "last_issue_cycle": cyc(last_product_ns), "work": steps * 8 + groups}
    for name, v in values.items():
        rec[gluon_trace.SLOT[name]] = v
    return rec


def _timeline():
    # SM 0: two programs with a 500 ns launch gap; SM 1: one program, then an idle block's program,
    # then nothing until the kernel's end (21000 ns)
    return torch.tensor([
        _record(0, 1000, 2000, 10500, 11000, ready_waits=(4000, 6000, 0), empty_wait=1700),
        _record(0, 11500, 12500, 20000, 21000, ready_waits=(3000, 3000, 0), empty_wait=1300),
        _record(1, 1200, 2200, 15000, 16000, groups=0b111, ready_waits=(1000, 1000, 1000), empty_wait=0),
        _record(1, 16200, 16200, 16200, 16300, steps=0, groups=0),
    ], dtype=torch.int64)


def test_summary_splits_every_sm_nanosecond_once():
    """Head, launch gaps, tail, fill, K loop, epilogue and idle-block programs partition the SMs' time:
    each figure as counted by hand from the made-up timeline, and the shares add up to 1."""
    s = tg.summarize(_timeline(), 2)
    sm_time = 2 * 20000  # two SMs over 1000 .. 21000 ns
    expect = {"head": (0 + 200) / sm_time, "between": (500 + 200) / sm_time, "tail": (0 + 4700) / sm_time,
              "fill": (1000 + 1000 + 1000) / sm_time, "k_loop": (8500 + 7500 + 12800) / sm_time,
              "epilogue": (500 + 1000 + 1000) / sm_time, "idle_blocks": 100 / sm_time}
    assert s["share"] == pytest.approx(expect)
    assert sum(s["share"].values()) == pytest.approx(1.0)
    assert s["sm_ghz"] == pytest.approx(GHZ)
    assert (s["programs"], s["live_programs"], s["sms"], s["programs_per_sm"]) == (4, 3, 2, 2.0)
    # 3 live programs of 2 x 48 K steps over 28800 ns of K loops
    assert s["us_per_k_step"] == pytest.approx(28800 / 288 / 1e3)
    # ready waits (cycles) over the live groups' K-loop cycles: 2 + 2 + 3 groups
    waits = 4000 + 6000 + 3000 + 3000 + 3000
    spans = GHZ * (2 * 8500 + 2 * 7500 + 3 * 12800)
    assert s["consumer_ready_wait"] == pytest.approx(waits / spans)
    assert s["producer_empty_wait"] == pytest.approx(3000 / (GHZ * (9500 + 8500 + 13800)))
    # 7 live groups of 2 x 48 products, 256 tensor-core cycles each, over the K loops' cycles
    assert s["tensor_core_busy"] == pytest.approx(7 * 96 * 256 / (GHZ * 28800))
    assert s["k_loop_weight_tiles_gbs"] == pytest.approx(288 * 128 * 128 / 28800 * 2)


def test_summary_refuses_records_it_cannot_read():
    with pytest.raises(ValueError, match=r"must be \[programs, 14\]"):
        tg.summarize(torch.zeros(3, 5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"must be \[programs"):
        tg.summarize(torch.zeros(0, gluon_trace.RECORD_SLOTS, dtype=torch.int64), 2)
    records = _timeline()
    records[2, gluon_trace.SLOT["end_ns"]] = 0  # a program that never wrote its end
    with pytest.raises(ValueError, match="left no record"):
        tg.summarize(records, 2)


def test_summary_counts_the_passes_each_program_makes_over_k():
    """The down's programs walk K once per column tile: three passes count 3/2 the gate/up's steps."""
    two, three = tg.summarize(_timeline(), 2), tg.summarize(_timeline(), 3)
    assert three["us_per_k_step"] == pytest.approx(two["us_per_k_step"] * 2 / 3)
    assert three["k_loop_weight_tiles_gbs"] == pytest.approx(two["k_loop_weight_tiles_gbs"] * 3 / 2)
    assert three["share"] == two["share"]


def test_capture_says_when_the_layer_did_not_run_the_192_row_kernels():
    with pytest.raises(SystemExit, match=r"launched the 192-row kernels \{'gate_up': 0, 'down': 0\} times.*"
                                         "MINIMAX_MOE_GEMM=gluon192"):
        tg.capture_launches(lambda: None)


def test_trace_needs_an_sm90_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU is here")
    with pytest.raises(SystemExit, match="needs triton's Gluon and an sm_90 GPU"):
        tg.main(["--tokens", "4096"])
    with pytest.raises(SystemExit, match="at least 1"):
        tg.main(["--tokens", "0"])


def test_gate_up_refuses_a_trace_buffer_it_cannot_fill():
    """The launcher checks the record buffer before launching: int64, one record per program, FP8."""
    from minimax_backend.kernels import moe_gluon as mg

    if not mg.HAVE_GLUON:
        pytest.skip("needs triton's Gluon")
    rows, k, n = 192, 256, 256
    xg = torch.zeros(rows, k).to(torch.float8_e4m3fn)
    xs = torch.ones(rows, k // 128)
    table = torch.zeros(2, dtype=torch.int64)
    blocks = torch.zeros(3, dtype=torch.int32)
    pairs = torch.zeros(rows, dtype=torch.int32)
    wanted = mg.trio_trace_slots(1, n)
    assert wanted == 2 * gluon_trace.RECORD_SLOTS  # two 128-column tiles of h, one program each
    for bad in (torch.zeros(wanted, dtype=torch.float32), torch.zeros(wanted - 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match=f"trace must be an int64 tensor of at least {wanted} values"):
            mg.gate_up_act_trio(xg, xs, table, table, blocks, pairs, 1, 2, n, 0, 1.0, 7.0, 1.0, -1, trace=bad)
    with pytest.raises(ValueError, match="with FP8 activations"):
        mg.gate_up_act_trio(xg.to(torch.bfloat16), xs, table, table, blocks, pairs, 1, 2, n, 0, 1.0, 7.0, 1.0, -1,
                            trace=torch.zeros(wanted, dtype=torch.int64))
    # the down: 256 output columns are two 128-column tiles, one program (both tiles) per block
    wanted = mg.down_trace_slots(1, 256)
    assert wanted == gluon_trace.RECORD_SLOTS
    with pytest.raises(ValueError, match=f"down_trio: trace must be an int64 tensor of at least {wanted} values"):
        mg.down_trio(xg, xs, table, table, blocks, pairs, torch.ones(rows), 1, 2, 256, -1,
                     trace=torch.zeros(wanted, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_traced_kernels_compute_the_same_outputs_and_a_record_per_program():
    """On an sm_90 GPU: the TRACE builds of the 192-row gate/up and down write the same h, scales and y
    bit for bit as the plain ones (the timers only read clocks), and every program a record whose
    times are in order, whose work field holds its K steps, and whose shares of the SM time add up
    to ~1 (the SM clock is converted per program, so not exactly)."""
    from minimax_backend.kernels import moe_gluon as mg
    from minimax_backend.kernels.moe import block_op_args
    from minimax_backend.kernels.options import override_kernel_options
    from minimax_backend.tools.bench_moe import build_block

    device = torch.device("cuda")
    if not mg.gluon_available(device):
        pytest.skip("needs triton's Gluon and an sm_90 GPU")
    cfg, blk = build_block("tiny-m3", 0, 1, True, device)
    x = torch.randn(999, cfg.hidden_size, device=device).to(torch.bfloat16)
    with override_kernel_options(moe_gemm="gluon192"):
        launches = tg.capture_launches(lambda: torch.ops.minimax.mega_moe(x, *block_op_args(blk), "", 1, False, False,
                                                                          999, "allgather"))
    S = gluon_trace.SLOT
    for name, kw in launches.items():
        slots, passes, steps = tg._trace_setup(name, kw)
        buf = torch.zeros(slots, dtype=torch.int64, device=device)
        plain, traced = tg._launch(name, kw), tg._launch(name, kw, buf)
        live_rows = kw["sorted_pair"] >= 0  # padding rows hold no meaningful value
        for a, b in zip(plain if isinstance(plain, tuple) else (plain,), traced if isinstance(traced, tuple) else (traced,)):
            rows = live_rows[: a.shape[0]]
            assert torch.equal(a[rows].view(torch.uint8), b[rows].view(torch.uint8)), name
        rec = buf.view(-1, gluon_trace.RECORD_SLOTS).cpu()
        live = (rec[:, S["work"]] & 1).bool()
        assert live.any(), name
        assert (rec[:, S["end_ns"]] > rec[:, S["entry_ns"]]).all(), name
        for a, b in (("entry_cycle", "first_ready_cycle"), ("first_ready_cycle", "last_product_cycle"),
                     ("last_product_cycle", "end_cycle"), ("producer_entry_cycle", "last_issue_cycle")):
            assert (rec[live, S[b]] >= rec[live, S[a]]).all(), (name, a, b)
        assert ((rec[live, S["work"]] >> 3) == steps).all(), name
        s = tg.summarize(rec, passes)
        assert sum(s["share"].values()) == pytest.approx(1.0, abs=0.05), (name, s["share"])
        assert 0.5 < s["sm_ghz"] < 2.5, name
