"""Build step for the optional native kernels (ggmlx/native); everything else is in pyproject.toml.

The native kernels (the int8 and int4 matvec, decode attention, the quantizers' scale searches:
one library, `_kernels`) are compiled with the system C++ compiler against the XLA FFI headers
that jaxlib ships. The build is optional: without a compiler, or when it fails, the install still succeeds and
ggmlx uses its pure-XLA path (ggmlx.native.available() is False).
No -march flags: each kernel picks AVX-512, AVX2 or plain loops on the running CPU.
"""
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing when the native kernels cannot be built."""

    def run(self):
        try:
            import jaxlib
            include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
            if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
                raise FileNotFoundError(f"no XLA FFI headers under {include}")
            for ext in self.extensions:
                ext.include_dirs.append(include)
            super().run()
        except Exception as e:  # noqa: BLE001 - any failure leaves the pure-XLA path
            print(f"ggmlx: the native kernels were not built ({type(e).__name__}: {e}); "
                  "the pure-XLA path will be used", file=sys.stderr)


setup(
    ext_modules=[Extension(
        "ggmlx.native._kernels",
        sources=["ggmlx/native/int8_matvec.cc", "ggmlx/native/attn_decode.cc", "ggmlx/native/quant_search.cc",
                 "ggmlx/native/block_matmul.cc", "ggmlx/native/top_k.cc"],
        depends=["ggmlx/native/half.h", "ggmlx/native/parallel.h"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type"],
    )],
    cmdclass={"build_ext": OptionalBuildExt},
)
