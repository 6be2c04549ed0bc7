"""attention/triton_compile.py's three descriptions of a kernel, one per Triton era.

CI's Triton (3.7.1) takes the newest form, which the compile tests run for real
(tests/attention/test_triton_forward.py). The two older forms (Triton 3.2; 3.0-3.1) were
checked against those releases by `scripts/test_triton_versions.sh` (every kernel compiles);
here Triton's classes are replaced by recorders of what they are given, so that a change to
the mapping (which arguments are 16-byte aligned, equal to 1, constant, and how each release
keys them) fails in CI, not on a user's PyTorch 2.4-2.6 at start-up.
"""

import sys
import types

import pytest

triton = pytest.importorskip("triton")

from megatron_eod.attention.triton_compile import compile_kernel  # noqa: E402


class _Kernel:
    arg_names = ["Q", "LSE", "TILES", "s_qt", "s_lt", "qk_scale", "HEADS", "BLOCK_M"]


class _Recorded:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _Hints:
    @classmethod
    def from_hints(cls, hints):
        return ("hints", dict(hints))


def _compile(monkeypatch, source_class, attrs_module=None, attrs=None):
    """compile_kernel under Triton classes replaced: (ASTSource's arguments, the options)."""
    import triton.backends.compiler
    import triton.compiler

    monkeypatch.setattr(triton.compiler, "ASTSource", source_class)
    monkeypatch.setattr(triton, "compile", lambda source, target, options: (source, options))
    if attrs_module == "backends":
        monkeypatch.setattr(triton.backends.compiler, "AttrsDescriptor", attrs, raising=False)
    else:
        monkeypatch.delattr(triton.backends.compiler, "AttrsDescriptor", raising=False)
        fake = types.ModuleType("triton.compiler.compiler")
        fake.AttrsDescriptor = attrs
        monkeypatch.setitem(sys.modules, "triton.compiler.compiler", fake)
        monkeypatch.setattr(triton.compiler, "compiler", fake, raising=False)
    source, options = compile_kernel(_Kernel, 90, "bf16", {"HEADS": 4, "BLOCK_M": 64},
                                     {"num_warps": 4}, ones=("s_lt",))
    assert options == {"num_warps": 4}
    return source


def test_triton_3_2_takes_names_and_hints(monkeypatch):
    class Source32(_Recorded):
        def __init__(self, fn, signature, constants=None, attrs=None):
            super().__init__(fn, signature, constants, attrs)

    source = _compile(monkeypatch, Source32, "backends", _Hints)
    fn, signature, constants, attrs = source.args
    assert fn is _Kernel
    assert signature == {"Q": "*bf16", "LSE": "*fp32", "TILES": "*i32", "s_qt": "i32",
                         "s_lt": "constexpr", "qk_scale": "fp32", "HEADS": "constexpr",
                         "BLOCK_M": "constexpr"}
    assert constants == {"HEADS": 4, "BLOCK_M": 64, "s_lt": 1}
    assert attrs == ("hints", {0: 16, 1: 16, 2: 16, 3: 16, 4: 1})


def test_triton_3_0_takes_indices_and_sets(monkeypatch):
    class Source30(_Recorded):
        def __init__(self, fn, signature, constants=None, attrs=None):
            super().__init__(fn, signature, constants, attrs)

    class Attrs30(_Recorded):
        pass

    source = _compile(monkeypatch, Source30, "compiler", Attrs30)
    fn, signature, constants, attrs = source.args
    assert signature == {0: "*bf16", 1: "*fp32", 2: "*i32", 3: "i32", 4: "i32", 5: "fp32"}
    assert constants == {6: 4, 7: 64, 4: 1}
    assert attrs.kwargs == {"divisible_by_16": {0, 1, 2, 3}, "equal_to_1": {4}}


def test_triton_3_3_on_takes_constexprs_by_index_tuple(monkeypatch):
    class Source33(_Recorded):
        def __init__(self, fn, signature, constexprs=None, attrs=None):
            super().__init__(fn, signature, constexprs=constexprs, attrs=attrs)

    source = _compile(monkeypatch, Source33, "backends", _Hints)
    assert source.kwargs["constexprs"] == {(6,): 4, (7,): 64, (4,): 1}
    assert source.kwargs["attrs"] == {(i,): [["tt.divisibility", 16]] for i in range(4)}
    assert source.args[1]["s_lt"] == "constexpr" and source.args[1]["s_qt"] == "i32"


def test_a_compiler_failure_is_told_in_a_line():
    """ptxas's first complaint, not its repro command (whose temporary file is gone); a
    jitted helper's error through the CompilationError it causes, not the source caret."""
    from megatron_eod.attention.triton_compile import _reason

    ptxas = RuntimeError("Internal Triton PTX codegen error\n`ptxas` stderr:\nptxas fatal   : "
                         "Value 'sm_90a' is not defined for option 'gpu-name'\n\nRepro command: "
                         "/x/ptxas -v /tmp/tmpab.ptx\n")
    assert _reason(ptxas) == ("RuntimeError: ptxas fatal   : Value 'sm_90a' is not defined "
                              "for option 'gpu-name'")
    try:
        try:
            raise ValueError("arange's range must be a power of 2")
        except ValueError as cause:
            raise SyntaxError("at 5:11:\n    return tl.load(X)\n           ^") from cause
    except SyntaxError as error:
        assert _reason(error) == "ValueError: arange's range must be a power of 2"
    assert _reason(RuntimeError("")) == "RuntimeError"
