"""kernels.torch_noise.Compiled runs eagerly only where torch.compile cannot build the loop; any
other error (a bug, an out-of-memory) reaches the caller and leaves compilation on."""
import warnings

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import CppCompileError, InductorError, InvalidCxxCompiler

from kernels import torch_noise
from kernels.torch_noise import COMPILE_MIN_NUMEL, Compiled

X = torch.arange(COMPILE_MIN_NUMEL, dtype=torch.float32)  # large enough to take the compiled path


def double_plus_one(x):
    return x * 2 + 1


def compile_that_raises(error, calls):
    """A stand-in for torch.compile whose compiled callable raises `error` when called."""
    def fake_compile(fn, **kwargs):
        def compiled(*args):
            calls.append(args)
            raise error
        return compiled
    return fake_compile


def no_compile_warning(record):
    return not any("compile unavailable" in str(w.message) for w in record)


COMPILE_FAILURES = {
    "no C++ compiler (as inductor reports it)": lambda: InductorError(InvalidCxxCompiler(), None),
    "C++ compile error": lambda: BackendCompilerFailed(double_plus_one, CppCompileError(["c++"], "error"), None),
    "no C++ compiler, unwrapped": lambda: InvalidCxxCompiler(),
}


@pytest.mark.parametrize("make_error", COMPILE_FAILURES.values(), ids=COMPILE_FAILURES.keys())
def test_a_compile_failure_falls_back_to_eager_for_good(monkeypatch, make_error):
    calls = []
    monkeypatch.setattr(torch, "compile", compile_that_raises(make_error(), calls))
    f = Compiled(double_plus_one)
    with pytest.warns(UserWarning, match="compile unavailable"):
        out = f(X)
    assert torch.equal(out, X * 2 + 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert torch.equal(f(X), X * 2 + 1)
    assert len(calls) == 1 and no_compile_warning(record)  # eager from then on, warned once


def test_an_unsupported_platform_runs_eager_without_compiling(monkeypatch):
    def refuse(fn, **kwargs):
        raise AssertionError("torch.compile called where dynamo is unsupported")
    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.warns(UserWarning, match="compile unavailable"):
        assert torch.equal(Compiled(double_plus_one)(X), X * 2 + 1)


OTHER_ERRORS = {
    "out of memory in the compiled run": lambda: torch.OutOfMemoryError("simulated"),
    "out of memory while compiling": lambda: InductorError(torch.OutOfMemoryError("simulated"), None),
    "a bug": lambda: IndexError("simulated"),
}


@pytest.mark.parametrize("make_error", OTHER_ERRORS.values(), ids=OTHER_ERRORS.keys())
def test_other_errors_of_the_compiled_call_propagate(monkeypatch, make_error):
    error, calls = make_error(), []
    monkeypatch.setattr(torch, "compile", compile_that_raises(error, calls))
    f = Compiled(double_plus_one)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(type(error)) as raised:
            f(X)
    assert raised.value is error and no_compile_warning(record)
    assert f.compiled is not False  # still compiled: the next call tries the compiled loop again
    with pytest.raises(type(error)):
        f(X)
    assert len(calls) == 2


def test_an_error_inside_the_function_propagates_through_real_compile():
    def buggy(x):
        raise ValueError("a genuine bug")
    f = Compiled(buggy)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="a genuine bug"):
            f(X)
    assert f.compiled is not False and no_compile_warning(record)


def test_compile_failures_are_told_apart_from_other_errors():
    assert torch_noise.is_compile_failure(InductorError(InvalidCxxCompiler(), None))
    assert not torch_noise.is_compile_failure(RuntimeError("CUDA error: an illegal memory access"))
    assert not torch_noise.is_compile_failure(torch.OutOfMemoryError("simulated"))
