"""Compiling the fused kernels ahead of a launch (attention/triton_compile.py), on the CPU.

The kernels compiled for sm_80 and sm_90 by CI's Triton (3.7.1) in a process whose
interpreter is off: their loads, shared memory and registers, and a kernel Triton rejects
named (KernelCompileError). The start-up check built on it (triton_forward.device_problem):
a GPU the kernels do not compile for, or whose shared memory PyTorch does not report. And
the two older ways of describing a kernel (Triton 3.2; 3.0-3.1), checked against those
releases by `scripts/test_triton_versions.sh` (every kernel compiles): here Triton's classes
are replaced by recorders of what they are given, so that a change to the mapping (which
arguments are 16-byte aligned, equal to 1, constant, and how each release keys them) fails
in CI, not at a user's start-up.
"""

import os
import subprocess
import sys
import types

import pytest
import torch

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


COMPILE = """
import os, re, subprocess, tempfile
import triton
from megatron_eod.attention.triton_backward import compile_backward_for, compile_delta_for
from megatron_eod.attention.triton_forward import compile_for
# What a GPU runs by default at the head dim most models use, bf16 at 128: on sm_90 (the GPUs
# we run) the forward, and the backward's three kernels (--cp-fused-backward); on sm_80 the
# forward. For CI's time (each compile 3-6 s, each ptxas 2 s, doubled on a loaded machine):
# the backward on sm_80, head dims 64, 80 (16-row tiles) and 256 and dq by atomic adds are
# compiled by scripts/test_triton_versions.sh, for CI's Triton too.
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def assert_no_spill(kernel, arch, name):
    \"\"\"No register spills (ptxas -v, Triton's own ptxas): the forward on sm_90 spilled 16
    bytes before its unmasked blocks (2026-11-28), and a shape spilling 252, 64 keys x 4
    warps, ran 1.5x slower.\"\"\"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a" if arch == 90 else "sm_80",
                             f.name, "-o", os.devnull], capture_output=True, text=True,
                            check=True).stderr
    spilled = int(re.search(r"([0-9]+) bytes spill stores", report).group(1))
    assert spilled == 0, (arch, name, report)


for arch in (80, 90):
    kernels = {"forward": compile_for(arch, "bf16", 128, 4, 128)}
    if arch == 90:
        kernels["dq"], kernels["dk/dv"] = compile_backward_for(arch, "bf16", 128, 4, 128)
        kernels["delta"] = compile_delta_for(arch, "bf16", 128)
    for name, kernel in kernels.items():
        assert kernel.asm["cubin"], (arch, name)
        # vectorised loads (16-byte aligned rows, as a launch specialises them), pipelined
        ptx = kernel.asm["ptx"]
        assert "ld.global.v4" in ptx, (arch, name)
        assert "cp.async" in ptx or name == "delta", (arch, name)
        assert kernel.metadata.shared <= LIMIT[arch], (arch, name, kernel.metadata.shared)
        assert_no_spill(kernel, arch, name)

# A kernel Triton cannot compile: KernelCompileError names it and the innermost error (a
# jitted helper's, not the CompilationError's source caret).
from broken_kernel import broken
from megatron_eod.attention.triton_compile import KernelCompileError, compile_kernel
try:
    compile_kernel(broken, 90, "bf16", {"BLOCK": 3}, {"num_warps": 4})
    raise AssertionError("compiled")
except KernelCompileError as error:
    assert error.kernel == "broken" and "power of 2" in error.reason, error.reason

# The start-up check: a device whose programs get too little shared memory is named.
import types
import torch
import megatron_eod.attention.triton_forward as tf
torch.cuda.current_device = lambda: 0
for (major, minor), name, optin in (((8, 9), "L40S", 101376), ((9, 0), "H100", 232448)):
    torch.cuda.get_device_capability = lambda index: (major, minor)
    torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(
        name=name, shared_memory_per_block_optin=optin)
    problem = tf.device_problem(256)
    assert (problem is None) == (name == "H100"), problem
    assert problem is None or ("KiB of shared memory per program at head dim 256 on L40S "
                               "(sm_89)" in problem), problem
# head dim 128 and the backward's fit too (compiled above)
assert tf.device_problem(128) is None and tf.device_problem(128, backward=True) is None
print("compiled")
"""
BROKEN = """
import triton
import triton.language as tl


@triton.jit
def _rows(X, BLOCK: tl.constexpr):
    return tl.load(X + tl.arange(0, BLOCK))


@triton.jit
def broken(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, 16), tl.sum(_rows(X, BLOCK)))
"""
# Shared memory a program may have: A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB.
LIMIT_LINE = "LIMIT = {80: 166912, 90: 232448}\n"


@pytest.mark.slow
@pytest.mark.timeout(900)  # its subprocess's own limit is 600 s; ~40 s here, 5+ min on a slow disk
def test_kernel_compiles_for_ampere_and_hopper(tmp_path):
    """Without a GPU: Triton (its own ptxas) compiles the kernels a GPU runs by default, bf16
    at head dim 128 (the forward on sm_80 and sm_90, the fused backward's on sm_90), in a
    process where its interpreter is off: loads vectorised and pipelined, shared memory within
    the GPU's, no register spills; a kernel Triton rejects is named; the start-up check
    refuses head_dim 256 where programs get 99 KiB (sm_89) and not where they get 227 (sm_90).
    Other head dims, tile sizes and Tritons: scripts/test_triton_versions.sh."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not read from a cache
    (tmp_path / "broken_kernel.py").write_text(BROKEN)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", LIMIT_LINE + COMPILE], env=env,
                            capture_output=True,
                            text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(
                                os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_a_gpu_the_kernels_do_not_compile_for_is_named_at_start_up(monkeypatch):
    """device_problem (the start-up check of --cp-fused-forward): Triton failing to compile
    a kernel for this GPU is a line naming the GPU, the Triton, the kernel and the flag to
    drop; a PyTorch that does not report the GPU's shared memory (< 2.7) is checked against
    the architecture's figure; an architecture without one is not checked."""
    import types

    import triton

    import megatron_eod.attention.triton_backward as tb
    import megatron_eod.attention.triton_forward as tf
    from megatron_eod.attention.triton_compile import KernelCompileError

    capability = [(12, 0)]
    props = types.SimpleNamespace(name="RTX 5090", shared_memory_per_block_optin=101376)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)

    def fails(arch, *args, **kwargs):
        raise KernelCompileError("attention_dkdv_kernel", arch, "RuntimeError: no MMA here")

    sizes = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=139264))  # 136 KiB
    monkeypatch.setattr(tf, "compile_for", lambda *args, **kwargs: sizes)
    monkeypatch.setattr(tb, "compile_backward_for", fails)
    where = f"RTX 5090 (sm_120) with Triton {triton.__version__}"
    assert tf.device_problem(128, backward=True) == (
        f"with --cp-fused-backward, the backward's attention_dkdv_kernel does not compile for "
        f"{where}: RuntimeError: no MMA here; drop --cp-fused-backward")
    monkeypatch.setattr(tf, "compile_for", fails)
    assert tf.device_problem(128) == (
        f"its kernel does not compile for {where}: RuntimeError: no MMA here; drop the flag")

    monkeypatch.setattr(tf, "compile_for", lambda *args, **kwargs: sizes)
    props = types.SimpleNamespace(name="L40S")  # PyTorch 2.6: no shared_memory_per_block_optin
    capability[0] = (8, 9)
    assert "need 136 KiB of shared memory per program at head dim 256 on L40S (sm_89), which " \
           "gives 99 KiB" in tf.device_problem(256)
    capability[0] = (13, 0)  # not in the table: the launch will say
    assert tf.device_problem(256) is None
