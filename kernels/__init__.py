"""Custom ops in the ``minimax::`` namespace. Importing this package registers them all."""

from . import fp8  # noqa: F401  (registers minimax::quantize_fp8, minimax::fp8_block_gemm)
from . import norm_quant  # noqa: F401  (registers minimax::rms_norm_quant_fp8)
from . import moe  # noqa: F401  (registers minimax::moe, minimax::mega_moe)
from . import gemm_rs  # noqa: F401  (registers minimax::gemm_rs)
from . import msa  # noqa: F401  (registers minimax::msa_select, minimax::msa_attention)
from . import stacked_gemm  # noqa: F401  (registers minimax::stacked_gemm)
