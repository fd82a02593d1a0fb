/* One-pass fp32 encoder of peerd's 8-bit blockwise codec (protocols/codec.v1.md).
 *
 * Each block is read from memory once: its absmax is taken while the block sits in L1, then the same
 * elements are scaled and rounded from there. The arithmetic is the torch path's in peerd/wire/blockwise.py
 * operation for operation (fp32 product with 1/127, bf16 round-up of the scale by carrying into the high
 * half, clamp, fp32 reciprocal, fp32 product, round half to even), so both produce the same bytes.
 *
 * AVX2 or SSE2 (every x86-64 has SSE2; the choice is made at import), a scalar loop elsewhere; no
 * -ffast-math, which would change the rounding. One thread, the caller's, with the GIL released: threads
 * started per call ran two to three times slower as often as faster on a 2-core machine, while a single one
 * already codes faster than a copy writes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#ifdef __SSE2__
#include <immintrin.h>
#endif

/* Elements to prefetch ahead of the block being read: the hardware prefetcher alone left the loops waiting on
 * memory (prefetching past the end of a buffer is harmless: it never faults). */
#define PREFETCH_AHEAD 1024

static const float MIN_SCALE = 0x1p-126f;
/* 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 to an integer, half to even. */
static const float ROUNDER = 12582912.0f;

static inline uint32_t f32_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The scale of a block whose largest |x| is absmax: rounded up to bf16, clamped; its bits go to *scale_out. */
static inline float block_scale(float absmax, float max_scale, uint16_t *scale_out) {
    float scale = bits_f32((f32_bits(absmax * (float)(1.0 / 127.0)) + 0xFFFFu) & 0xFFFF0000u);
    scale = scale < MIN_SCALE ? MIN_SCALE : (scale > max_scale ? max_scale : scale);
    *scale_out = (uint16_t)(f32_bits(scale) >> 16);
    return scale;
}

/* Elements [from, n) one at a time; 0 if one is NaN or Inf. */
static inline int quantize_tail(const float *x, Py_ssize_t from, Py_ssize_t n, float inverse, int8_t *codes) {
    int finite = 1;
    for (Py_ssize_t k = from; k < n; k++) {
        float y = x[k] * inverse;
        finite &= fabsf(x[k]) <= FLT_MAX; /* false for NaN too */
        codes[k] = finite ? (int8_t)(int32_t)((y + ROUNDER) - ROUNDER) : 0;
    }
    return finite;
}

/* Portable version: also the reference the vector versions follow. Returns 0 if the block holds NaN or Inf
 * (its scale and codes are then unspecified). */
static int quantize_block_scalar(const float *x, Py_ssize_t n, float max_scale, uint16_t *scale_out,
                                 int8_t *codes) {
    float absmax = 0.0f;
    for (Py_ssize_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        absmax = a > absmax ? a : absmax;
    }
    float inverse = 1.0f / block_scale(absmax, max_scale, scale_out);
    return quantize_tail(x, 0, n, inverse, codes);
}

#ifdef __SSE2__
/* NaN and Inf need no pass of their own: maxps keeps its second operand (the running peak) when the first is
 * NaN, so the scale stays finite, and cvtps2dq turns NaN, Inf and x / MAX_SCALE for Inf into INT32_MIN, which
 * the saturating packs make code -128, a code no finite input yields. cvtps2dq rounds in the current mode:
 * half to even unless a program changed MXCSR. */
static int quantize_block_sse2(const float *x, Py_ssize_t n, float max_scale, uint16_t *scale_out,
                               int8_t *codes) {
    const __m128 sign = _mm_set1_ps(-0.0f);
    __m128 peak0 = _mm_setzero_ps(), peak1 = _mm_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_prefetch((const char *)(x + i + PREFETCH_AHEAD), _MM_HINT_T0);
        peak0 = _mm_max_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + i)), peak0);
        peak1 = _mm_max_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + i + 4)), peak1);
    }
    float lanes[4], absmax = 0.0f;
    _mm_storeu_ps(lanes, _mm_max_ps(peak0, peak1));
    for (int j = 0; j < 4; j++)
        absmax = lanes[j] > absmax ? lanes[j] : absmax;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        absmax = a > absmax ? a : absmax;
    }
    float inverse = 1.0f / block_scale(absmax, max_scale, scale_out);
    const __m128 inv = _mm_set1_ps(inverse);
    const __m128i lowest = _mm_set1_epi8(-128);
    __m128i bad = _mm_setzero_si128();
    Py_ssize_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m128i q0 = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + k), inv));
        __m128i q1 = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + k + 4), inv));
        __m128i q2 = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + k + 8), inv));
        __m128i q3 = _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(x + k + 12), inv));
        __m128i packed = _mm_packs_epi16(_mm_packs_epi32(q0, q1), _mm_packs_epi32(q2, q3));
        bad = _mm_or_si128(bad, _mm_cmpeq_epi8(packed, lowest));
        _mm_storeu_si128((__m128i *)(codes + k), packed);
    }
    return quantize_tail(x, k, n, inverse, codes) && !_mm_movemask_epi8(bad);
}

/* The SSE2 version 8 lanes wide, for CPUs with AVX2 (chosen at import). */
__attribute__((target("avx2"))) static int quantize_block_avx2(const float *x, Py_ssize_t n, float max_scale,
                                                               uint16_t *scale_out, int8_t *codes) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 peak0 = _mm256_setzero_ps(), peak1 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm_prefetch((const char *)(x + i + PREFETCH_AHEAD), _MM_HINT_T0);
        peak0 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), peak0);
        peak1 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8)), peak1);
    }
    float lanes[8], absmax = 0.0f;
    _mm256_storeu_ps(lanes, _mm256_max_ps(peak0, peak1));
    for (int j = 0; j < 8; j++)
        absmax = lanes[j] > absmax ? lanes[j] : absmax;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        absmax = a > absmax ? a : absmax;
    }
    float inverse = 1.0f / block_scale(absmax, max_scale, scale_out);
    const __m256 inv = _mm256_set1_ps(inverse);
    const __m256i lowest = _mm256_set1_epi8(-128);
    /* packs work within 128-bit halves; this puts the 4-byte groups back in element order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i bad = _mm256_setzero_si256();
    Py_ssize_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inv));
        __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), inv));
        __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), inv));
        __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), inv));
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        packed = _mm256_permutevar8x32_epi32(packed, order);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(packed, lowest));
        _mm256_storeu_si256((__m256i *)(codes + k), packed);
    }
    return quantize_tail(x, k, n, inverse, codes) && !_mm256_movemask_epi8(bad);
}
#endif

typedef int (*BlockQuantizer)(const float *, Py_ssize_t, float, uint16_t *, int8_t *);
static BlockQuantizer quantize_block = quantize_block_scalar;

/* quantize(src, scales, codes, block, max_scale) -> bool: False if src holds NaN or Inf. */
static PyObject *quantize(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer src, scales, codes;
    Py_ssize_t block;
    float max_scale;
    int finite = 1;
    if (!PyArg_ParseTuple(args, "y*w*w*nf", &src, &scales, &codes, &block, &max_scale))
        return NULL;
    Py_ssize_t numel = src.len / (Py_ssize_t)sizeof(float);
    Py_ssize_t nblocks = block > 0 ? (numel + block - 1) / block : 0;
    int fits = block > 0 && src.len % (Py_ssize_t)sizeof(float) == 0 && codes.len == numel &&
               scales.len == 2 * nblocks;
    if (fits) {
        const float *values = (const float *)src.buf;
        uint16_t *scale_bits = (uint16_t *)scales.buf;
        int8_t *code_bytes = (int8_t *)codes.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < nblocks && finite; b++) {
            Py_ssize_t start = b * block, n = numel - start < block ? numel - start : block;
            finite = quantize_block(values + start, n, max_scale, scale_bits + b, code_bytes + start);
        }
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Format(PyExc_ValueError, "quantize: %zd value bytes, %zd code bytes and %zd scale bytes do not fit "
                     "block %zd", src.len, codes.len, scales.len, block);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&codes);
    return fits ? PyBool_FromLong(finite) : NULL;
}

static const char *isa_name(BlockQuantizer q) {
#ifdef __SSE2__
    if (q == quantize_block_avx2)
        return "avx2";
    if (q == quantize_block_sse2)
        return "sse2";
#endif
    return q == quantize_block_scalar ? "scalar" : "?";
}

/* isa(name=None) -> str: the instruction set encoding uses; a name switches to it if this CPU has it. */
static PyObject *isa(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
    if (name != NULL) {
        BlockQuantizer chosen = NULL;
        if (strcmp(name, "scalar") == 0)
            chosen = quantize_block_scalar;
#ifdef __SSE2__
        else if (strcmp(name, "sse2") == 0)
            chosen = quantize_block_sse2;
        else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2"))
            chosen = quantize_block_avx2;
#endif
        if (chosen == NULL)
            return PyErr_Format(PyExc_ValueError, "instruction set %s is not available here", name);
        quantize_block = chosen;
    }
    return PyUnicode_FromString(isa_name(quantize_block));
}

static PyMethodDef methods[] = {
    {"isa", isa, METH_VARARGS,
     "isa(name=None) -> str\n\nThe instruction set encoding uses (avx2, sse2 or scalar); a name switches to it."},
    {"quantize", quantize, METH_VARARGS,
     "quantize(src, scales, codes, block, max_scale) -> bool\n\n"
     "Encodes fp32 ``src`` into bf16 block ``scales`` and int8 ``codes``; False if src holds NaN or Inf."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockwise", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__blockwise(void) {
#ifdef __SSE2__
    __builtin_cpu_init();
    quantize_block = __builtin_cpu_supports("avx2") ? quantize_block_avx2 : quantize_block_sse2;
#endif
    return PyModule_Create(&module);
}
