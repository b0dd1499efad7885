"""Running the Triton kernels on CPU ranks: whether Triton's interpreter is on, and one speed-up for it.

On a CPU (``TRITON_INTERPRET=1``) every kernel runs in Triton's interpreter, one program after
another, each ``tl`` op a few numpy calls. Triton 3.6's interpreter also re-patches the whole
``triton.language`` namespace (``inspect.getmembers`` over three modules, about 2 ms) at every
call of a ``@triton.jit`` helper from inside a kernel, although the kernel's launch has already
patched it and the nested patch is never undone: a no-op that was about a third of a CPU
dispatch. Its builder also runs ``sanitize_overflow`` on every 32-bit integer add, sub and mul
(casts to int64, two compares, an and) only to hand the result to ``device_assert``, which
returns at once because the interpreter's ``debug`` is off: another fifth, computed and dropped.

``speed_up()`` skips the nested patch when the namespace is already patched and turns the
sanitizer off while ``debug`` is off; the launch-level patch and its restore are untouched, so
kernels compute exactly what they did.
"""
from __future__ import annotations

import dataclasses
import os

_applied = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def speed_up() -> bool:
    """Installs the skip described in the module docstring, once; returns whether it is installed.

    Does nothing (returns False) outside the interpreter or when Triton's interpreter does not
    have the shape this was written against (then kernels run exactly as Triton ships them).
    """
    global _applied
    if _applied:
        return True
    if not interpreting():
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_cls is None or not hasattr(tl.core, "is_builtin"):
        return False

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        # A launch patches these modules before any helper runs; a patched ``load`` is no
        # longer a builtin, so a helper called inside the launch finds nothing left to patch.
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return scope_cls()
        return original(fn)

    interpreter._patch_lang = patch_lang
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    _applied = True
    return True
