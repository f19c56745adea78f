"""Custom ops in the ``minimax::`` namespace. Importing this package registers them all.

Two kinds of module, imported in this order:

* op modules define each op (``torch.library.custom_op``), its fake (meta)
  kernel and its plain-torch reference, which is the op's implementation on
  every device without a kernel of its own;
* GPU modules import their op module and register the op's CUDA kernel
  (``op.register_kernel("cuda")``), falling back to the reference where the
  kernel does not apply (no Triton, an unsupported dtype, ...). They import
  cleanly without a GPU and without Triton.

Imports only ever go GPU module -> op module, never back.
"""

if __name__ != "minimax_backend.kernels":
    # This folder found as a top-level `kernels` (the repository root on sys.path, as under
    # `python -m pytest` run there): transformers imports Hugging Face's package of that name
    # (5.25 requires it). A second copy of these modules would define every minimax:: op again,
    # and the ops would then run the copy, whose kernel options override_kernel_options does not
    # reach. So: hand the name to the package found elsewhere on sys.path (the import system
    # returns what sys.modules holds once this file has run), or be an empty package without
    # submodules where there is none (tests/test_import_names.py).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module
        _spec.loader.exec_module(_module)
    else:
        __path__ = []
else:
    # op modules
    from . import fp8  # noqa: F401  (minimax::quantize_fp8, minimax::fp8_block_gemm)
    from . import norm_quant  # noqa: F401  (minimax::rms_norm_quant_fp8)
    from . import norm_rope  # noqa: F401  (minimax::rms_norm_rope)
    from . import moe  # noqa: F401  (minimax::moe, minimax::mega_moe)
    from . import gemm_rs  # noqa: F401  (minimax::gemm_rs)
    from . import msa  # noqa: F401  (minimax::msa_select, minimax::msa_attention)
    from . import stacked_gemm  # noqa: F401  (minimax::stacked_gemm; no kernel of its own: its GEMMs dispatch)
    from . import allreduce_norm  # noqa: F401  (minimax::allreduce_rms_norm_quant; the unfused ops)

    # GPU modules: the ops' CUDA kernels
    from . import fp8_gemm_cuda  # noqa: F401  (fp8_block_gemm)
    from . import norm_quant_triton  # noqa: F401  (rms_norm_quant_fp8, quantize_fp8)
    from . import norm_rope_triton  # noqa: F401  (rms_norm_rope)
    from . import moe_triton  # noqa: F401  (moe, mega_moe)
    from . import gemm_rs_cuda  # noqa: F401  (gemm_rs)
    from . import msa_triton  # noqa: F401  (msa_select, msa_attention)
    from . import allreduce_norm_cuda  # noqa: F401  (allreduce_rms_norm_quant, behind MINIMAX_ALLREDUCE_NORM)
