"""Run a fast decode step's bound calls as one C++ call (``program.cpp``).

``FastDecoder`` binds a step as a list of no-argument calls (``model/fast_decode.py``). Each
that is ``functools.partial(op, *args, **kwargs)`` of an operator overload
(``torch.ops.ns.op.overload``) with every argument bound becomes an entry of a ``CallProgram``; a
run of such calls is then one Python call, the program looping over the dispatcher in C++ (the
per-call Python cost was ~0.25 ms of a ~2 ms 90m step). Any other call (a Python closure, a MoE block's forward) stays
as it is, between programs, so the order of the calls never changes and neither do the results.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


def _entry(call: Callable[[], None]) -> tuple[str, str, tuple] | None:
    """(op name, overload, every schema argument in order) for a fully bound operator call, else None."""
    if not isinstance(call, functools.partial) or not isinstance(call.func, torch._ops.OpOverload):
        return None
    schema = call.func._schema  # what it returns is dropped, as the plan's loop drops it
    args, kwargs = list(call.args), dict(call.keywords)
    if len(args) > len(schema.arguments):
        return None
    for a in schema.arguments[len(args):]:
        if a.name in kwargs:
            args.append(kwargs.pop(a.name))
        elif a.has_default_value():
            args.append(a.default_value)
        else:
            return None
    if kwargs:
        return None
    # An empty list goes as None: program.cpp types it from the schema.
    return schema.name, schema.overload_name, tuple(None if isinstance(a, (list, tuple)) and not a else a
                                                    for a in args)


def compile_calls(calls: list[Callable[[], None]]) -> list[Callable[[], None]]:
    """``calls`` with each run of operator calls replaced by one ``CallProgram.run`` (same order)."""
    out: list[Callable[[], None]] = []
    program = None  # the program the current run of operator calls goes into
    for call in calls:
        entry = _entry(call)
        if entry is not None:
            target = program if program is not None else torch.classes.trainforge_cpu.CallProgram()
            try:
                target.add(*entry)
            except RuntimeError:  # an argument the conversion cannot type: the call stays a Python call
                pass
            else:
                if program is None:
                    program = target
                    out.append(program.run)
                continue
        out.append(call)
        program = None
    return out
