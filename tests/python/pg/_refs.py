"""Inputs and independent expectations for the collective tests.

Every rank can rebuild every other rank's input from a seed, so each rank
computes the expected result of a collective itself (numpy for integers and
bool, a rank-order fold for floats), without the backend under test; where
gloo supports the dtype and operation, the tests also compare with gloo's
result on the same inputs.

Imported by the spawned ranks: no pytest here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

INT_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
HALF_DTYPES = [torch.float16, torch.bfloat16]
FLOAT_DTYPES = HALF_DTYPES + [torch.float32, torch.float64]
COMPLEX_DTYPES = [torch.complex32, torch.complex64, torch.complex128]
FLOAT8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# What the backend reduces, and what it only moves.
REDUCE_DTYPES = INT_DTYPES + FLOAT_DTYPES + [torch.bool]
MOVE_DTYPES = REDUCE_DTYPES + COMPLEX_DTYPES + FLOAT8_DTYPES
# What ProcessGroupGloo accepts at all (torch 2.11): no int16, no uint16/32/64, no float8.
GLOO_DTYPES = {
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
    torch.complex128,
}

ALL_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def dtype_id(dtype) -> str:
    return str(dtype).replace("torch.", "")


def ops_for(dtype):
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype in INT_DTYPES:
        return list(ALL_OPS)
    if dtype in FLOAT_DTYPES:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    if dtype in COMPLEX_DTYPES:
        return ["SUM", "AVG"]
    return []


def reduce_op(name):
    return getattr(dist.ReduceOp, name)


def gloo_reduces(dtype, op) -> bool:
    """Whether gloo's result is a usable reference for (dtype, op)."""
    if dtype not in GLOO_DTYPES:
        return False
    if op == "AVG" and (dtype in INT_DTYPES or dtype == torch.bool):
        return False  # gloo cannot divide in place for integers
    if dtype == torch.bool and op == "SUM":
        return False  # gloo adds the bytes: True + True comes back as the byte 2, not a bool
    if (dtype in HALF_DTYPES or dtype == torch.complex32) and op in ("SUM", "AVG", "PRODUCT"):
        return False  # gloo accumulates in half precision; mooncake in fp32 (checked by formula)
    return True


# ---------------------------------------------------------------------------
# Inputs


def _np_dtype(dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def random_bytes(n_bytes, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=n_bytes, dtype=np.uint8))


def make(dtype, shape, seed, purpose="bits"):
    """A reproducible tensor.

    purpose: "bits" (any bit pattern, for data movement; NaNs included),
    "sum" (values whose sum over 4 ranks neither overflows nor loses
    integers), "prod" (small magnitudes), "minmax" (full range, no NaN).
    """
    if isinstance(shape, int):
        shape = (shape,)
    n = int(np.prod(shape)) if len(shape) else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=n).astype(np.bool_)).reshape(shape)
    if dtype in FLOAT8_DTYPES or (purpose == "bits" and dtype not in COMPLEX_DTYPES):
        esize = torch.empty(0, dtype=dtype).element_size()
        return random_bytes(n * esize, seed).view(dtype).reshape(shape)
    if dtype in INT_DTYPES:
        npd = _np_dtype(dtype)
        info = np.iinfo(npd)
        if purpose == "sum":
            lo, hi = info.min // 8, info.max // 8
        elif purpose == "prod":
            lo, hi = (0 if info.min == 0 else -3), 3
        else:
            lo, hi = info.min, info.max
        return torch.from_numpy(rng.integers(lo, hi, size=n, dtype=npd, endpoint=True)).reshape(shape)
    if dtype in COMPLEX_DTYPES:
        real = torch.from_numpy(rng.standard_normal(n) * 4)
        imag = torch.from_numpy(rng.standard_normal(n) * 4)
        return torch.complex(real, imag).to(dtype).reshape(shape)
    if purpose == "prod":
        values = rng.uniform(0.5, 2.0, size=n) * rng.choice([-1.0, 1.0], size=n)
    elif purpose == "minmax":
        values = rng.standard_normal(n) * 100
    else:
        values = rng.standard_normal(n) * 8
    return torch.from_numpy(values).to(dtype).reshape(shape)


def purpose_for(op):
    return {"SUM": "sum", "AVG": "sum", "PRODUCT": "prod"}.get(op, "minmax")


def integer_valued(shape, seed, dtype=torch.float32, bound=1000):
    """Integer-valued floats: sums over a few ranks are exact in any order."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(-bound, bound, size=shape, endpoint=True)).to(dtype)


# ---------------------------------------------------------------------------
# Expectations

_NP_FOLD = {
    "SUM": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}


def reduce_ref(inputs, op):
    """The reduction of `inputs` (one tensor per rank, in rank order).

    Integers and bool: exact (numpy in the same dtype; bool SUM is OR and
    PRODUCT is AND); integer AVG truncates toward zero. Floats: folded in rank
    order; float16/bfloat16 accumulate in float32 and are rounded once.
    """
    dtype = inputs[0].dtype
    world = len(inputs)
    if dtype == torch.bool or dtype in INT_DTYPES:
        arrays = [x.numpy() for x in inputs]
        if op == "AVG":
            total = np.add.reduce(arrays)  # bounded inputs: no overflow
            if np.iinfo(total.dtype).min < 0:
                out = np.sign(total) * (np.abs(total) // world)
            else:
                out = total // world
            return torch.from_numpy(np.ascontiguousarray(out.astype(arrays[0].dtype)))
        fold = _NP_FOLD[op]
        acc = arrays[0].copy()
        for a in arrays[1:]:
            acc = fold(acc, a)
        return torch.from_numpy(np.ascontiguousarray(acc.astype(arrays[0].dtype)))
    if dtype == torch.complex32:  # two float16 lanes: accumulated in float32, rounded once
        work = [x.to(torch.complex64) for x in inputs]
    else:
        work = [x.float() if dtype in HALF_DTYPES else x.clone() for x in inputs]
    acc = work[0]
    for x in work[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PRODUCT":
            acc = acc * x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        elif op == "MAX":
            acc = torch.maximum(acc, x)
        else:
            raise ValueError(op)
    if op == "AVG":
        acc = acc / world
    return acc.to(dtype)


# ---------------------------------------------------------------------------
# Comparisons (raise AssertionError with enough context to debug)


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(actual, expected, what):
    """Bit-exact equality (movement): same shape and dtype, same bytes."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = as_bytes(actual), as_bytes(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().reshape(-1)
        first = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} bytes differ, first at byte {first} "
            f"(got {int(a[first])}, expected {int(e[first])})"
        )


def assert_reduced(actual, expected, what, exact=None):
    """Equality of a reduction result. Exact for integers, bool and
    float16/bfloat16 (fp32 accumulation, rounded once); close for
    float32/float64/complex, whose summation order is not specified."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype == torch.complex32:  # few operators take it: compare the float16 lanes
        actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
    if exact is None:
        exact = not (actual.is_floating_point() or actual.is_complex()) or actual.dtype in HALF_DTYPES
    if exact:
        if actual.is_floating_point():
            torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")
        else:
            assert_same_bits(actual, expected, what)
    else:
        torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}")
