"""The C++ call program (infer/cpu_kernels/call_program.py): a list of bound calls, runs of
operator calls compiled into one C++ call each, does what the Python loop over the same list does."""

from __future__ import annotations

import functools

import pytest
import torch

from trainforge.infer.cpu_kernels.call_program import compile_calls

p = functools.partial


def _calls(ops, x: torch.Tensor, y: torch.Tensor, log: list[str]):
    """Order-dependent in-place work: operator calls (ours and ATen's, one with a keyword-only
    ``out=`` and one with a defaulted ``alpha``) around a Python closure that reads x mid-way."""
    w, idx = torch.linspace(0.5, 1.5, x.shape[1]), torch.tensor([1, 0])
    return [p(torch.ops.aten.mul_.Scalar, x, 3.0),
            p(torch.ops.aten.add_.Tensor, x, y),
            lambda: log.append(f"{x.sum().item():.6f}"),
            p(ops.rms_norm_into.default, x, w, 1e-5, y),
            p(torch.ops.aten.index_select.out, y, 0, idx, out=x),
            p(torch.ops.aten.add_.Tensor, x, y, alpha=2.0)]


def test_compiled_calls_do_what_the_python_loop_does_in_the_same_order(ops):
    gen = torch.Generator().manual_seed(0)
    x0, y0 = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    (xa, ya, la), (xb, yb, lb) = (x0.clone(), y0.clone(), []), (x0.clone(), y0.clone(), [])
    plain = _calls(ops, xa, ya, la)
    compiled = compile_calls(_calls(ops, xb, yb, lb))
    assert len(compiled) == 3  # a program, the closure, a program
    for _ in range(2):  # a program runs again on the tensors' current values
        for call in plain:
            call()
        for call in compiled:
            call()
    assert la == lb and len(la) == 2
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, x0)


def test_calls_that_are_not_fully_bound_operators_stay_python_calls(ops):
    x = torch.zeros(3)
    unbound = p(torch.ops.aten.add_.Tensor, x)  # 'other' missing: the Python call would raise, so must this
    method = p(x.add_, 1.0)  # a bound method, not an operator overload
    packet = p(torch.ops.aten.add_, x, x)  # an overload packet: which overload is Python's choice
    assert compile_calls([unbound, method, packet]) == [unbound, method, packet]


def test_an_empty_tensor_list_argument_is_typed_from_the_schema(ops):
    x, cos, sin = torch.randn(1, 2, 8), torch.ones(1, 8), torch.zeros(1, 8)
    calls = compile_calls([p(ops.rope_into.default, [], cos, sin), p(ops.rope_into.default, [x], cos, sin),
                           p(torch.ops.aten.mul_.Scalar, x, 2.0)])
    want = 2 * x
    assert len(calls) == 1
    calls[0]()
    assert torch.equal(x, want)  # cos 1, sin 0: the rotation is the identity


def test_an_argument_the_conversion_cannot_type_leaves_that_call_in_python(ops):
    x = torch.ones(3)
    odd = p(torch.ops.aten.add_.Tensor, x, x, alpha=object())  # no IValue for an arbitrary object
    calls = compile_calls([p(torch.ops.aten.mul_.Scalar, x, 2.0), odd, p(torch.ops.aten.mul_.Scalar, x, 3.0)])
    assert len(calls) == 3 and calls[1] is odd


def test_an_error_inside_a_program_names_the_op_and_stops_there(ops):
    x, bad_out = torch.ones(2, 8), torch.empty(2, 7)
    calls = compile_calls([p(torch.ops.aten.mul_.Scalar, x, 2.0),
                           p(ops.rms_norm_into.default, x, torch.ones(8), 1e-5, bad_out),
                           p(torch.ops.aten.mul_.Scalar, x, 5.0)])
    with pytest.raises(RuntimeError, match="rms_norm"):
        calls[0]()
    assert torch.equal(x, torch.full((2, 8), 2.0))  # the call before ran, the one after did not
