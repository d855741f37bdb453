"""The FP8 KV-cache record (pallas_kernels/kv_record.py) against a numpy model of FlashMLA's
`fp8_ds_mla` layout written here from the spec, byte for byte, and against hand-computed cases."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import kv_record

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16

encode = jax.jit(kv_record.encode, static_argnums=1)
decode = jax.jit(kv_record.decode, static_argnums=(1, 2, 3))

LAYOUTS = [(512, 64), (128, 32), (128, 0)]  # (128, 0): an indexer key
LEADS = [(3, 5), (7,), ()]
DTYPES = [BF16, np.float32]


# ---- the numpy model -------------------------------------------------------------------------

def _ceil_log2(y: np.ndarray) -> np.ndarray:
    """ceil(log2 y) for positive float32 y, from frexp (y = m 2^k, m in [0.5, 1)) rather than
    the bit fields the module reads."""
    m, k = np.frexp(y)
    return np.where(m == 0.5, k - 1, k).astype(np.int64)


def _scale_exponents_and_codes(xf: np.ndarray, nope: int) -> tuple[list, list]:
    exps, codes = [], []
    for start in range(0, nope, 64):
        blk = xf[:, start: min(start + 64, nope)]
        amax = np.maximum(np.abs(blk).max(axis=1), np.float32(1e-4))
        e = _ceil_log2(amax * np.float32(1 / 448))
        s = np.ldexp(np.float32(1), e).astype(np.float32)
        q = np.clip(blk / s[:, None], np.float32(-448), np.float32(448)).astype(np.float32)
        exps.append(e)
        codes.append(q.astype(E4M3))
    return exps, codes


def numpy_encode(x: np.ndarray, rope: int) -> np.ndarray:
    d = x.shape[-1]
    nope = d - rope
    nb = (nope + 63) // 64
    size = (nope + 2 * rope + nb + 7) // 8 * 8
    flat = x.reshape(-1, d)
    exps, codes = _scale_exponents_and_codes(flat.astype(np.float32), nope)
    out = np.zeros((flat.shape[0], size), np.uint8)
    out[:, :nope] = np.concatenate(codes, axis=1).view(np.uint8)
    out[:, nope: nope + 2 * rope] = flat[:, nope:].astype(BF16).view(np.uint16).astype("<u2").view(np.uint8)
    out[:, nope + 2 * rope: nope + 2 * rope + nb] = np.stack(exps, axis=1) + 127
    return out.reshape(*x.shape[:-1], size)


def numpy_decode(rec: np.ndarray, d: int, rope: int, dtype) -> np.ndarray:
    nope = d - rope
    nb = (nope + 63) // 64
    flat = rec.reshape(-1, rec.shape[-1])
    codes = np.ascontiguousarray(flat[:, :nope]).view(E4M3).astype(np.float32)
    e = flat[:, nope + 2 * rope: nope + 2 * rope + nb].astype(np.int64) - 127
    s = np.repeat(np.ldexp(np.float32(1), e).astype(np.float32), 64, axis=1)[:, :nope]
    rope_vals = np.ascontiguousarray(flat[:, nope: nope + 2 * rope]).view("<u2").view(BF16)
    out = np.concatenate([(codes * s).astype(dtype), rope_vals.astype(dtype)], axis=1)
    return out.reshape(*rec.shape[:-1], d)


# ---- data ------------------------------------------------------------------------------------

def _e4m3_midpoints() -> np.ndarray:
    """Every value halfway between two neighbouring positive finite e4m3 values (ties)."""
    grid = np.arange(0x00, 0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)  # 0x7F is NaN
    return (grid[:-1] + grid[1:]) / 2


def _specials(rng, w: int, dtype) -> list[np.ndarray]:
    """Blocks of w values that probe the edges of the quantization."""
    sign = rng.choice([-1.0, 1.0], w).astype(np.float32)
    k = np.float32(2.0 ** rng.integers(-30, 30))
    ties = rng.choice(_e4m3_midpoints(), w) * sign
    ties[0] = 448  # amax 448 2^k: the scale is exactly 2^k, so all the others are ties
    huge = rng.standard_normal(w).astype(np.float32) * np.float32(1e37)
    huge[0] = 2.5e38  # scale 2^119; past 448 2^119 the scale is 2^120 and 256 2^120 is no float32
    blocks = [
        np.zeros(w, np.float32),                                                     # amax floor
        rng.standard_normal(w).astype(np.float32) * np.float32(1e-7),                # under the floor
        np.where(rng.random(w) < 0.5, 1e-12, 3e-6).astype(np.float32) * sign,        # flushed to zero
        huge,
        -np.abs(rng.standard_normal(w)).astype(np.float32) * np.float32(50),         # all negative
        np.ldexp(np.float32(1), rng.integers(-20, 20, w)).astype(np.float32) * sign,  # powers of two
        ties * k,
    ]
    if dtype == np.float32:  # a hair off a tie: rounds away from it (no double rounding via f16)
        near = ties * np.float32(1 + 2.0 ** -20) * k
        near[0] = 448 * k
        blocks.append(near)
    return blocks


def _entries(lead: tuple, d: int, rope: int, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    nope = d - rope
    nb = (nope + 63) // 64
    n = max(int(np.prod(lead)), 1)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, :nope] *= np.repeat(np.exp2(rng.uniform(-40, 40, (n, nb))), 64, axis=1)[:, :nope].astype(np.float32)
    x[:, nope:] *= np.exp2(rng.uniform(-20, 20, (n, rope))).astype(np.float32)
    for i, block in enumerate(_specials(rng, 64, dtype)):
        row, j = i % n, i % nb  # with two blocks, every other special lands in the partial one
        width = min(64, nope - 64 * j)
        x[row, 64 * j: 64 * j + width] = block[:width]
    return x.astype(dtype).reshape(*lead, d)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


CASES = [(d, rope, lead, dtype) for d, rope in LAYOUTS for lead in LEADS for dtype in DTYPES]
IDS = [f"D{d}-rope{r}-{'x'.join(map(str, lead)) or 'one'}-{np.dtype(t).name}" for d, r, lead, t in CASES]


# ---- tests -----------------------------------------------------------------------------------

def test_record_bytes():
    assert kv_record.BLOCK == 64
    assert kv_record.record_bytes(512, 64) == 448 + 128 + 7 + 1 == 584
    assert kv_record.record_bytes(128, 32) == 168  # 96 + 64 + 2 = 162, padded to 8
    assert kv_record.record_bytes(128, 0) == 136  # an indexer key: 128 + 2 = 130, padded to 8


@pytest.mark.parametrize("d,rope,lead,dtype", CASES, ids=IDS)
def test_encode_matches_numpy_model(d, rope, lead, dtype):
    x = _entries(lead, d, rope, dtype, seed=d + len(lead))
    got = np.asarray(encode(jnp.asarray(x), rope))
    assert got.dtype == np.uint8
    assert got.shape == (*lead, kv_record.record_bytes(d, rope))
    np.testing.assert_array_equal(got, numpy_encode(x, rope))


@pytest.mark.parametrize("d,rope,lead,dtype", CASES, ids=IDS)
def test_decode_matches_numpy_model(d, rope, lead, dtype):
    rec = numpy_encode(_entries(lead, d, rope, dtype, seed=7 * d + len(lead)), rope)
    for out in (BF16, np.float32):
        got = np.asarray(decode(jnp.asarray(rec), d, rope, out))
        assert got.dtype == out and got.shape == (*lead, d)
        np.testing.assert_array_equal(_bits(got), _bits(numpy_decode(rec, d, rope, out)))
    np.testing.assert_array_equal(_bits(decode(jnp.asarray(rec), d, rope)), _bits(numpy_decode(rec, d, rope, BF16)))


@pytest.mark.parametrize("d,rope,lead,dtype", CASES, ids=IDS)
def test_round_trip_error_bound(d, rope, lead, dtype):
    """e4m3 keeps 3 mantissa bits, so rounding x / s to the nearest code moves it by at most half
    an ulp: 2^-4 |x / s| for normal codes (|x / s| >= 2^-6), 2^-10 for subnormal ones (spacing
    2^-9). Hence |x^ - x| <= max(2^-4 |x|, 2^-10 s) per value, and per block
    <= max(2^-4 amax, 2^-10 s): the first unless amax is under the 1e-4 floor (otherwise
    s <= 2 amax / 448). The clamp never binds here (|x / s| <= 448 with no scale rounded down)."""
    nope = d - rope
    x = _entries(lead, d, rope, dtype, seed=11 * d + len(lead))
    rec = np.asarray(encode(jnp.asarray(x), rope)).reshape(-1, kv_record.record_bytes(d, rope))
    back = np.asarray(decode(jnp.asarray(rec), d, rope, np.float32)).reshape(-1, d)
    xf = x.astype(np.float32).reshape(-1, d)
    s = np.ldexp(1.0, rec[:, nope + 2 * rope: nope + 2 * rope + (nope + 63) // 64].astype(np.int64) - 127)
    s = np.repeat(s, 64, axis=1)[:, :nope]
    err = np.abs(back[:, :nope].astype(np.float64) - xf[:, :nope])
    assert np.all(err <= np.maximum(2.0 ** -4 * np.abs(xf[:, :nope]), 2.0 ** -10 * s))
    for start in range(0, nope, 64):
        blk = slice(start, min(start + 64, nope))
        bound = np.maximum(2.0 ** -4 * np.abs(xf[:, blk]).max(axis=1), 2.0 ** -10 * s[:, start])
        assert np.all(err[:, blk].max(axis=1) <= bound)
    # The rope part is stored as bf16: bit-exact for bf16 input, bf16-rounded for float32.
    np.testing.assert_array_equal(_bits(back[:, nope:].astype(BF16)), _bits(xf[:, nope:].astype(BF16)))
    if dtype == BF16:
        np.testing.assert_array_equal(_bits(back[:, nope:].astype(BF16)), _bits(x.reshape(-1, d)[:, nope:]))


BOTH, FP32 = (BF16, np.float32), (np.float32,)


@pytest.mark.parametrize("amax,byte,dtypes", [
    (448.0, 127, BOTH),        # y = 448 * fl(1/448) = 1 exactly: scale 2^0
    (449.0, 128, FP32),        # y just over 1: 2^1 (bf16 has no 449)
    (450.0, 128, BOTH),
    (224.0, 126, BOTH),        # y = 1/2
    (896.0, 128, BOTH),        # y = 2
    (900.0, 129, BOTH),
    (1.0, 119, BOTH),          # y = 1/448 in (2^-9, 2^-8]
    (0.0, 105, BOTH),          # floor 1e-4: y = 2.23e-7 in (2^-23 = 1.19e-7, 2^-22 = 2.38e-7]
    (2.0 ** -14, 105, BOTH),   # under the floor too
    (float(ml_dtypes.finfo(BF16).max), 247, BOTH),  # 3.39e38: y = 7.57e35 in (2^119 = 6.65e35, 2^120]
])
def test_scale_byte_by_hand(amax, byte, dtypes):
    for dtype in dtypes:
        # D=128, rope=32: block 0 is values 0..63, block 1 (partial) 64..95, scales at bytes 160, 161.
        x = np.float32(amax) / 4 * np.linspace(-1, 1, 128, dtype=np.float32)
        x[5] = -amax
        x[64:96] = np.linspace(-0.5, 1, 32)  # the partial block's own amax: 1 -> 119, whatever block 0 holds
        assert np.float32(amax) == np.float32(dtype(amax))  # the hand case is exact in this dtype
        rec = np.asarray(encode(jnp.asarray(x.astype(dtype)), 32))
        assert rec[160] == byte and rec[161] == 119
        np.testing.assert_array_equal(rec[162:], 0)


def test_layout_by_hand():
    x = np.zeros(128, np.float32)
    x[0], x[1], x[2] = 448, 1.0, -0.5  # block 0's scale 2^0: codes are the values
    x[96], x[97] = 1.5, -2.0           # rope: bf16 0x3FC0, 0xC000
    rec = np.asarray(encode(jnp.asarray(x), 32))
    assert list(rec[:4]) == [0x7E, 0x38, 0xB0, 0x00]  # e4m3: 448, 1, -0.5, 0
    np.testing.assert_array_equal(rec[3:96], 0)
    assert list(rec[96:100]) == [0xC0, 0x3F, 0x00, 0xC0]  # little-endian
    np.testing.assert_array_equal(rec[100:160], 0)
    assert list(rec[160:]) == [127, 105, 0, 0, 0, 0, 0, 0]  # block 1 all zeros: amax floor


def test_ties_round_to_even_by_hand():
    # Scale 2^0 (amax 448): each value is its own e4m3 argument.
    vals = [448, 1.0625, 1.1875, 17, 19, 2.0 ** -10, 3 * 2.0 ** -10, -1.0625, 1.0625 + 2.0 ** -20, 460]
    want = [448, 1.0, 1.25, 16, 20, 0, 2.0 ** -8, -1.0, 1.125, 448]
    x = np.zeros(128, np.float32)
    x[: len(vals)] = vals
    got = np.asarray(decode(encode(jnp.asarray(x), 32), 128, 32, np.float32))
    np.testing.assert_array_equal(got[: len(vals)], np.float32(want))


def test_records_as_words_keep_their_bytes():
    """to_words / from_words: the cache's uint32 words hold a record's bytes in order (little-endian
    words, as numpy views them on this machine), and come back unchanged."""
    rec = np.random.default_rng(0).integers(0, 256, (3, 5, 584), dtype=np.uint8)
    words = np.asarray(kv_record.to_words(jnp.asarray(rec)))
    assert words.dtype == np.uint32 and words.shape == (3, 5, 146)
    np.testing.assert_array_equal(words.view(np.uint8), rec)
    np.testing.assert_array_equal(np.asarray(kv_record.from_words(jnp.asarray(words))), rec)

