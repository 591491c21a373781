"""LLVM intrinsics numba does not expose: population count and cache prefetch.

Plain functions usable inside ``@njit`` code; each compiles to one instruction.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Bytes per cache line (x86-64 and most ARM cores).
CACHE_LINE = 64


@intrinsic
def popcount(typingctx, x):
    """LLVM's ctpop: one instruction on any x86-64 with POPCNT."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)])
        return builder.call(fn, args)

    return sig, codegen


def _prefetch_call(builder, ptr):
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    # read, high temporal locality, data cache
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])


@intrinsic
def prefetch_flat(typingctx, arr, i):
    """Ask the cache to load ``arr[i]`` (1-D array) soon, for reading; never faults."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    sig = types.void(arr, types.intp)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        _prefetch_call(builder, ptr)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, row, col):
    """Ask the cache to load ``arr[row, col]`` (2-D array) soon, for reading; never faults.

    Why: the exact rerank reads a few hundred random rows of a large array; the
    hardware prefetcher cannot guess the next row, so each row start is a full
    memory latency unless the kernel asks for it a few rows ahead.
    """
    if not (isinstance(arr, types.Array) and arr.ndim == 2):
        return None
    sig = types.void(arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]], wraparound=False)
        _prefetch_call(builder, ptr)
        return context.get_dummy_value()

    return sig, codegen
