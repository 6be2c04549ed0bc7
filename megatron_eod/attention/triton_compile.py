"""The fused kernels compiled ahead of a launch, without a GPU (Triton ships its own ptxas).

One job: `compile_kernel`, a jitted kernel compiled for a CUDA architecture, specialised as a
launch specialises it (16-byte aligned pointers and strides, the strides known to be 1), by
the version of Triton installed. The start-up check of `--cp-fused-forward` uses it (the
shared memory a program needs on this GPU: triton_forward.device_problem) and so do the
tests (the machine code on sm_80 and sm_90, its registers and loads). Triton changed how a
kernel is described to its compiler twice; the three forms, each checked by
`scripts/test_triton_versions.sh`:
* Triton >= 3.3 (PyTorch >= 2.7): constexprs and attributes keyed by (argument index,);
* Triton 3.2 (PyTorch 2.6): arguments by name, `AttrsDescriptor.from_hints`;
* Triton 3.0-3.1 (PyTorch 2.4-2.5): arguments by index, the constexprs left out of the
  signature, `AttrsDescriptor(divisible_by_16=, equal_to_1=)`.

What it does not do: no launch (triton_forward.py, triton_backward.py launch through the
kernel's own JIT), no kernel.
"""

from __future__ import annotations

import inspect

__all__ = ["KernelCompileError", "compile_kernel"]


class KernelCompileError(RuntimeError):
    """Triton could not compile a kernel for an architecture: `kernel` names it, the message
    says why in a line (the innermost error; ptxas's own words where ptxas failed)."""

    def __init__(self, kernel: str, arch: int, reason: str):
        super().__init__(f"{kernel} does not compile for sm_{arch}: {reason}")
        self.kernel, self.arch, self.reason = kernel, arch, reason


def _reason(error: BaseException) -> str:
    """What went wrong, in a line: the innermost cause (a jitted helper's error is a
    CompilationError's cause), ptxas's first complaint where it failed, never the source
    caret, the repro command or its deleted temporary file."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error)
    lines = text.split("`ptxas` stderr:", 1)[-1].splitlines()
    lines = [line.strip() for line in lines if line.strip() and line.strip() != "^"
             and not line.strip().startswith("Repro command")]
    if not lines:
        return type(error).__name__
    line = lines[0] if "`ptxas` stderr:" in text else lines[-1]
    return f"{type(error).__name__}: {line[:300]}"

# Pointers other than to the attention's dtype, and the scalars.
_TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "TILES": "*i32", "KEY_TILES": "*i32",
          "ROW_START": "*i32", "qk_scale": "fp32", "sm_scale": "fp32", "rows": "i32"}


def compile_kernel(kernel, arch, dtype, constants, options, ones=(), float32=()):
    """`kernel` compiled for `arch` (e.g. 90), specialised as a launch is: pointers and the
    strides named s_* 16-aligned (what lets the loads be vectorised), those in `ones` equal
    to 1 (lse is [H, T] memory read as [T, H]); pointers to `dtype` but lse, delta and those
    named in `float32` (float32) and the tiles (int32); scales float32. `constants`: the
    kernel's constexpr arguments by name; `options`: num_warps, num_stages.
    -> Triton's CompiledKernel; KernelCompileError where Triton cannot compile it (a
    mistake of ours in describing it raises as it is)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    types = dict(_TYPES, **{name: "*fp32" for name in float32})
    signature = {name: types.get(name, "i32" if name.startswith("s_") else f"*{dtype}")
                 for name in names}
    aligned = [i for i, name in enumerate(names) if name not in constants and name not in ones
               and (signature[name].startswith("*") or name.startswith("s_"))]
    unit = [names.index(name) for name in ones]
    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:  # Triton >= 3.3
        signature.update({name: "constexpr" for name in (*constants, *ones)})
        constexprs = {(names.index(name),): value for name, value in constants.items()}
        constexprs.update({(i,): 1 for i in unit})
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    else:
        source = _before_3_3(kernel, names, signature, constants, aligned, unit)
    try:
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # noqa: BLE001 - the compiler's failures, whatever their class
        raise KernelCompileError(getattr(kernel, "__name__", str(kernel)), arch,
                                 _reason(error)) from error


def _before_3_3(kernel, names, signature, constants, aligned, unit):
    """The kernel's ASTSource as Triton 3.0-3.2 take it."""
    from triton.compiler import ASTSource

    values = dict(constants, **{names[i]: 1 for i in unit})
    try:  # Triton 3.2: by name, the constexprs typed so
        from triton.backends.compiler import AttrsDescriptor
    except ImportError:  # Triton 3.0-3.1: by index, no constexpr in the signature
        from triton.compiler.compiler import AttrsDescriptor

        return ASTSource(kernel, {i: kind for i, (name, kind) in enumerate(signature.items())
                                  if name not in constants},
                         {names.index(name): value for name, value in values.items()},
                         AttrsDescriptor(divisible_by_16=set(aligned), equal_to_1=set(unit)))
    signature.update({name: "constexpr" for name in values})
    hints = {**{i: 16 for i in aligned}, **{i: 1 for i in unit}}
    return ASTSource(kernel, signature, values, AttrsDescriptor.from_hints(hints))
