"""One GCWS step over 32 samples, written as explicit LLVM vector code.

A step takes one coordinate (its ``lx = ln ũ``) against a block of 32 samples'
constants and keeps each sample's running minimum of

    ln a = base − rate·⌊lx·(1/r) + β⌋

(float32 constants widened to float64, the arithmetic float64, no fused
multiply-add: bit for bit what the plain numba loop computes). Why not that
loop: numba cannot tell LLVM that its arrays do not overlap, so the vectorized
loop re-checks the overlap of every pair of arrays on every step (~130
instructions for a step of ~60), and it turns the selects into masked stores
that stall the next step's loads. Here the state lives in one float64 array —
row 0 the running minimum, row 1 the step's position at that minimum, row 2
(walk only) a tie flag — read and written whole with plain vector loads and
stores.

The callers guarantee the shapes (32 lanes; state ``(3, 32)`` for the walk,
``(≥2, 32)`` otherwise; constants ``(5, 32)`` or ``(4, 32)``): the intrinsics
check types, not sizes.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Samples per step.
LANES = 32
#: Doubles per LLVM vector (one AVX-512 register; LLVM splits it on narrower machines).
_WIDTH = 8

_F64, _F32, _I64, _I32 = ir.DoubleType(), ir.FloatType(), ir.IntType(64), ir.IntType(32)
_VD, _VF = ir.VectorType(_F64, _WIDTH), ir.VectorType(_F32, _WIDTH)


def _is_c_array(t, dtype, ndim: int) -> bool:
    return isinstance(t, types.Array) and t.dtype == dtype and t.ndim == ndim and t.layout == "C"


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


def _splat(builder, x):
    v = builder.insert_element(ir.Constant(_VD, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VD, ir.Undefined), ir.Constant(ir.VectorType(_I32, _WIDTH),
                                                                                [0] * _WIDTH))


def _vload(builder, ptr, offset: int, vtype, align: int):
    p = builder.gep(ptr, [ir.Constant(_I64, offset)])
    return builder.load(builder.bitcast(p, vtype.as_pointer()), align=align)


def _vstore(builder, value, ptr, offset: int, align: int) -> None:
    p = builder.gep(ptr, [ir.Constant(_I64, offset)])
    builder.store(value, builder.bitcast(p, value.type.as_pointer()), align=align)


def _emit(builder, lx_of_chunk, consts, first_row: int, state, pos, track_ties: bool) -> None:
    """The step: ``lx_of_chunk(c)`` gives the 8 lanes' ``lx`` of chunk ``c``; ``consts``
    points at float32 rows (1/r, β, base, rate) starting at row ``first_row``."""
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VD, [_VD]), "llvm.floor.v8f64")
    pos_v = _splat(builder, pos)
    one = ir.Constant(_VD, [1.0] * _WIDTH)
    for c in range(LANES // _WIDTH):
        row = [_vload(builder, consts, (first_row + s) * LANES + c * _WIDTH, _VF, 4) for s in range(4)]
        invr, beta, base, rate = (builder.fpext(r, _VD) for r in row)
        t = builder.call(floor, [builder.fadd(builder.fmul(lx_of_chunk(c), invr), beta)])
        la = builder.fsub(base, builder.fmul(rate, t))
        best = _vload(builder, state, c * _WIDTH, _VD, 8)
        take = builder.fcmp_ordered("<", la, best)
        _vstore(builder, builder.select(take, la, best), state, c * _WIDTH, 8)
        arg = _vload(builder, state, LANES + c * _WIDTH, _VD, 8)
        _vstore(builder, builder.select(take, pos_v, arg), state, LANES + c * _WIDTH, 8)
        if track_ties:
            tie = _vload(builder, state, 2 * LANES + c * _WIDTH, _VD, 8)
            eq = builder.fcmp_ordered("==", la, best)
            _vstore(builder, builder.select(eq, one, tie), state, 2 * LANES + c * _WIDTH, 8)


@intrinsic
def gather_step(typingctx, lx, cc, consts, state, pos):
    """The sorted walk's step: lane ``j`` takes ``lx[cc[j]]``; ``consts`` rows 1–4 are
    (1/r, β, base, rate) (row 0 is the walk's bound); marks ties in ``state[2]``."""
    ok = (_is_c_array(lx, types.float64, 1) and _is_c_array(cc, types.uint32, 1)
          and _is_c_array(consts, types.float32, 2) and _is_c_array(state, types.float64, 2))
    if not ok:
        return None
    sig = types.void(lx, cc, consts, state, types.float64)

    def codegen(context, builder, signature, args):
        lxp, ccp, cp, sp_ = (_data(context, builder, t, v) for t, v in zip(signature.args[:4], args[:4], strict=True))

        def lx_of_chunk(c):
            v = ir.Constant(_VD, ir.Undefined)
            for i in range(_WIDTH):
                idx = builder.zext(builder.load(builder.gep(ccp, [ir.Constant(_I64, c * _WIDTH + i)])), _I64)
                v = builder.insert_element(v, builder.load(builder.gep(lxp, [idx])), ir.Constant(_I32, i))
            return v

        _emit(builder, lx_of_chunk, cp, 1, sp_, args[4], True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def broadcast_step(typingctx, lx, consts, state, pos):
    """The nonzero-major kernel's step: every lane takes the same ``lx``; ``consts``
    rows 0–3 are (1/r, β, base, rate); earlier positions win ties (no tie flag)."""
    ok = (isinstance(lx, types.Float) and _is_c_array(consts, types.float32, 2)
          and _is_c_array(state, types.float64, 2))
    if not ok:
        return None
    sig = types.void(types.float64, consts, state, types.float64)

    def codegen(context, builder, signature, args):
        cp = _data(context, builder, signature.args[1], args[1])
        sp_ = _data(context, builder, signature.args[2], args[2])
        lx_v = _splat(builder, args[0])
        _emit(builder, lambda c: lx_v, cp, 0, sp_, args[3], False)
        return context.get_dummy_value()

    return sig, codegen
