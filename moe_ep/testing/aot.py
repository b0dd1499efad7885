"""Compile a recorded kernel launch for a GPU target without a GPU (Triton + bundled ptxas).

Used by the tests to catch GPU-only compile errors (which the CPU interpreter never sees) on a
machine with no GPU: record the launches of a CPU run, then compile each for sm_90.
"""
from __future__ import annotations

import inspect

import torch
import triton
from triton.backends.compiler import GPUTarget

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


def signature(arg_names, args: tuple, consts: dict) -> dict:
    """A launch as plain data: {'sig': {param: triton type}, 'consts': {...}} (picklable)."""
    sig = {}
    for name, a in zip(arg_names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i64" if not -2**31 <= a < 2**31 else "i32"
        else:
            sig[name] = "fp32"
    return {"sig": sig, "consts": dict(consts)}


def compile_for(fn, spec: dict, arch: int = 90):
    """Compiles JIT function ``fn`` for a launch ``spec`` (from ``signature``) for
    ``cuda:sm_<arch>``; returns the compiled kernel (``.asm['ptx']``, ``.asm['cubin']``; its registers
    and spills come from ``cuobjdump -res-usage`` on the cubin, as no GPU loads it here).
    Raises on any compile error. Must run without TRITON_INTERPRET."""
    sig, cexpr, attrs = {}, {}, {}
    consts = spec["consts"]
    options = {k: v for k, v in consts.items() if k not in fn.arg_names}
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()}
    for i, name in enumerate(fn.arg_names):
        if name in spec["sig"]:
            sig[name] = spec["sig"][name]
            if sig[name].startswith("*"):  # torch allocations are 16-byte aligned, as Triton assumes
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr"
            cexpr[(i,)] = consts[name] if name in consts else defaults[name]  # (a launch may leave a default)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cexpr, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def descriptor_type(dtype: str, block: list, element_bits: int) -> str:
    """The signature type of a Gluon TMA descriptor argument with ``block`` (no swizzle), as the
    launcher specializes a real descriptor."""
    from triton.experimental.gluon.language._layouts import NVMMASharedLayout

    layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element_bits, rank=len(block))
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def compile_gluon_for(fn, sig: dict, consts: dict, arch: int = 90, num_warps: int = 4):
    """``compile_for`` for a Gluon kernel: ``sig`` gives each runtime parameter's type (pointers as
    ``*i32``, descriptors from ``descriptor_type``), ``consts`` the constexprs."""
    from triton.experimental.gluon._runtime import GluonASTSource

    full, cexpr, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            full[name] = "constexpr"
            cexpr[(i,)] = consts[name]
        else:
            full[name] = sig[name]
            if sig[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=fn, signature=full, constexprs=cexpr, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
