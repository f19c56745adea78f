"""FX patterns the passes match: the search side (what subgraph of the functional
ATen graph a pass looks for) and the replace side (match objects that know how to
rewrite themselves and erase the old nodes, in the style of PyTorch's
micro_pipeline_tp.py), one file per pattern family:

    fx.py              the helpers every pattern shares (op names, fake values, Mismatch)
    collectives.py     functional collectives and their waits
    token_wise.py      which ops treat every token (row) independently
    linears.py         linears, activations and gated MLPs
    moe_block.py       the eager MoE block -> minimax::moe
    moe_collectives.py minimax::moe and its collectives -> minimax::mega_moe
    norm_quant.py      RMSNorm -> FP8 quantization sites
    gemm_rs.py         a GEMM feeding only a reduce-scatter
    stacked_linears.py linears on one input whose weights are stacked rows
    allreduce_norm.py  an all-reduce that only the next RMSNorm (and its residual add) reads
    sequence_parallel.py  the residual stream's all-reduces -> reduce-scatter + gathers
"""
