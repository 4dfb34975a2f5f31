"""Plugin kernels (data-plane layer): TensorRT's kernel ABI, its Triton sources, AOT build, launcher.

What it is for: the two data-plane kernels in the form a TensorRT AOT plugin
launches them (`abi.py`: ordered parameters and launch rules, plain ints),
their Triton sources (`abi_kernels.py`), PTX fix-up and assembly (`ptx.py`),
the ahead-of-time build with its manifest (`build.py`), and a launcher that
runs the built PTX through the CUDA driver API (`aot_launcher.py`), so the
binary TensorRT would run is testable without TensorRT or Triton.

Importing this package imports neither torch nor triton; each module imports
what it needs.
"""
