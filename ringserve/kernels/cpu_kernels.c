/* CPU kernels, built at first use by `cpu_native.py`.
 *
 * decode_attention: paged decode attention, one new query per sequence over
 * its pooled context, read from the KV pool in place (no gather of K/V rows
 * into a dense copy first); compared with `paged_attention_reference`.
 * add_rmsnorm: the residual add and RMSNorm of `add_rmsnorm_reference`, in
 * one pass over each row, rounding where the reference rounds.
 * rope_store: RoPE of the new tokens' queries and keys ("rotate half"), the
 * rotated keys and the values written straight into their pool slots, as
 * `apply_rope` then `store_kv_reference`.
 * silu_mul: SwiGLU's silu(gate) * up over the fused [gate | up] rows, in one
 * pass, rounding where torch's silu and mul_ round.
 *
 * Layout, all contiguous: q and out [B, Hq, D]; k_cache and v_cache
 * [capacity, Hkv, D]; req_slots [B, W] int64, of which row b's first
 * seq_lens[b] entries are its context's slots. Hq is a multiple of Hkv: the
 * Hq / Hkv query heads of one KV head share its K/V reads. Scores and sums
 * are float32 whatever the storage type; bfloat16 is read and written as its
 * 16 bits (round to nearest even on output).
 *
 * Work items are sequences, split over `threads` threads.
 */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int64_t *slots, *lens;
    int64_t width, hq, hkv, dim, dtype;
    float scale;
    int64_t first, last; /* work items [first, last) */
    int status;
} Job;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Rows are scattered over the pool, where the hardware prefetcher cannot
 * follow: each loop asks for the row AHEAD slots on. */
enum { AHEAD = 4 };

static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)row + at, 0, 3);
}

/* Whether each of the n slots lies in the pool, [0, capacity): a kernel
 * checks its slots before it reads or writes the pool, and returns
 * BAD_SLOT instead of touching memory outside it. */
enum { BAD_SLOT = 4 };

static int slots_in_pool(const int64_t *slots, int64_t n, int64_t capacity) {
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] < 0 || slots[i] >= capacity) return 0;
    return 1;
}

/* The vector primitives: loads of a stored type into floats, the rounding
 * of floats to bfloat16 and their stores (vround_bf16, vstore_bf16: as
 * f32_to_bf16, bit for bit), a dot product of a float query with a stored
 * row (dot, and dot4 for four rows at once), x = exp(x - top) returning the
 * sum (exp_shift), and silu. They are written once over `vec`, LANES floats
 * wide: 16 with AVX-512, 8 with AVX2 and FMA. Decode attention needs them
 * (head sizes a multiple of 16); the norm, silu and rope run them over whole
 * lanes and plain loops over what the lanes leave, and the plain loops alone
 * in a build for a CPU with neither. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vload_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
/* the larger of each lane pair, `a` where x is NaN */
static inline vec vmax(vec x, vec a) { return _mm512_max_ps(x, a); }
static inline float vtop(vec a) { return _mm512_reduce_max_ps(a); }

/* The four sums of four vectors' lanes, as one 4-lane vector. */
static inline __m128 vsum4(vec a, vec b, vec c, vec d) {
    /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then the same for c, d */
    vec ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    vec cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: [a, b, c, d] summed over the lane */
    vec abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    /* then over the four 128-bit lanes */
    abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(1, 0, 3, 2)));
    abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(abcd);
}

static inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
static inline vec vclamp(vec x, float lo, float hi) {
    /* min and max return their second operand, x, when it is NaN */
    return _mm512_max_ps(vset(lo), _mm512_min_ps(vset(hi), x));
}
static inline vec vscale2(vec p, vec n) { return _mm512_scalef_ps(p, n); }
static inline vec vzero_below(vec e, vec x, float lo) {
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, vset(lo), _CMP_LT_OQ), e);
}
static inline vec vinf_above(vec e, vec x, float hi) {
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, vset(hi), _CMP_GT_OQ), vset(INFINITY));
}
/* x rounded to bfloat16 as f32_to_bf16 rounds (nearest even, NaN kept
 * quiet), still a float: its low 16 bits are zero */
static inline vec vround_bf16(vec x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
/* the high halves of LANES floats already rounded by vround_bf16 */
static inline void vstore_bf16(uint16_t *p, vec x) {
    const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(high));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vload_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline vec vmax(vec x, vec a) { return _mm256_max_ps(x, a); }
static inline float vtop(vec a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* The four sums of four vectors' lanes, as one 4-lane vector. */
static inline __m128 vsum4(vec a, vec b, vec c, vec d) {
    /* [a0123, b0123, c0123, d0123 | a4567, b4567, c4567, d4567] */
    vec h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline vec vround(vec x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vclamp(vec x, float lo, float hi) {
    /* min and max return their second operand, x, when it is NaN */
    return _mm256_max_ps(vset(lo), _mm256_min_ps(vset(hi), x));
}
/* p * 2^n for integral n in [-126, 127], through the exponent bits */
static inline vec vscale2(vec p, vec n) {
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline vec vzero_below(vec e, vec x, float lo) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, vset(lo), _CMP_LT_OQ), e);
}
static inline vec vinf_above(vec e, vec x, float hi) {
    return _mm256_blendv_ps(e, vset(INFINITY), _mm256_cmp_ps(x, vset(hi), _CMP_GT_OQ));
}
static inline vec vround_bf16(vec x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const vec kept = _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet),
                                      _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_and_ps(kept, _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
}
static inline void vstore_bf16(uint16_t *p, vec x) {
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    /* per 128-bit lane the four words twice; then the two lanes' first copies */
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high),
                                                   _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(words));
}
#endif

#ifdef LANES
/* exp(x) = 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6
 * (relative error about 2e-7); below -87 it is 0, above 88 infinity, and a
 * NaN stays NaN. */
static inline vec vexp(vec x) {
    vec c = vclamp(x, -87.0f, 88.0f);
    vec n = vround(vmul(c, vset(1.44269504088896341f)));
    vec r = vfnma(n, vset(0.693147180559945309f), c);
    vec p = vset(1.0f / 720);
    p = vfma(p, r, vset(1.0f / 120));
    p = vfma(p, r, vset(1.0f / 24));
    p = vfma(p, r, vset(1.0f / 6));
    p = vfma(p, r, vset(0.5f));
    p = vfma(p, r, vset(1.0f));
    p = vfma(p, r, vset(1.0f));
    return vinf_above(vzero_below(vscale2(p, n), x, -87.0f), x, 88.0f);
}

#define vload_f32 vload
#define vstore_f32 vstore
static inline vec vround_f32(vec x) { return x; }

#define DEFINE_VECTOR(SUFFIX, ELEM)                                                           \
    static inline float dot_##SUFFIX(const float *q, const ELEM *k, int64_t n) {              \
        vec a = vzero(), b = vzero();                                                         \
        int64_t d = 0;                                                                        \
        for (; d + 2 * LANES <= n; d += 2 * LANES) {                                          \
            a = vfma(vload(q + d), vload_##SUFFIX(k + d), a);                                 \
            b = vfma(vload(q + d + LANES), vload_##SUFFIX(k + d + LANES), b);                 \
        }                                                                                     \
        for (; d < n; d += LANES) a = vfma(vload(q + d), vload_##SUFFIX(k + d), a);           \
        return vsum(vadd(a, b));                                                              \
    }                                                                                         \
    /* out[0:4] = the dot products of q with four rows, reduced together */                \
    static inline void dot4_##SUFFIX(const float *q, const ELEM *k0, const ELEM *k1,          \
                                     const ELEM *k2, const ELEM *k3, int64_t n, float *out) { \
        vec t0 = vzero(), t1 = t0, t2 = t0, t3 = t0;                                          \
        for (int64_t d = 0; d < n; d += LANES) {                                              \
            const vec qd = vload(q + d);                                                      \
            t0 = vfma(qd, vload_##SUFFIX(k0 + d), t0);                                        \
            t1 = vfma(qd, vload_##SUFFIX(k1 + d), t1);                                        \
            t2 = vfma(qd, vload_##SUFFIX(k2 + d), t2);                                        \
            t3 = vfma(qd, vload_##SUFFIX(k3 + d), t3);                                        \
        }                                                                                     \
        _mm_storeu_ps(out, vsum4(t0, t1, t2, t3));                                            \
    }                                                                                         \
    /* dot4 of two queries with the same four rows, each row read once for both */         \
    static inline void dot4x2_##SUFFIX(const float *q, const float *p, const ELEM *k0,        \
                                       const ELEM *k1, const ELEM *k2, const ELEM *k3,        \
                                       int64_t n, float *out, float *pout) {                  \
        vec t0 = vzero(), t1 = t0, t2 = t0, t3 = t0, u0 = t0, u1 = t0, u2 = t0, u3 = t0;      \
        for (int64_t d = 0; d < n; d += LANES) {                                              \
            const vec qd = vload(q + d), pd = vload(p + d);                                   \
            const vec x0 = vload_##SUFFIX(k0 + d), x1 = vload_##SUFFIX(k1 + d);               \
            const vec x2 = vload_##SUFFIX(k2 + d), x3 = vload_##SUFFIX(k3 + d);               \
            t0 = vfma(qd, x0, t0), u0 = vfma(pd, x0, u0);                                     \
            t1 = vfma(qd, x1, t1), u1 = vfma(pd, x1, u1);                                     \
            t2 = vfma(qd, x2, t2), u2 = vfma(pd, x2, u2);                                     \
            t3 = vfma(qd, x3, t3), u3 = vfma(pd, x3, u3);                                     \
        }                                                                                     \
        _mm_storeu_ps(out, vsum4(t0, t1, t2, t3));                                            \
        _mm_storeu_ps(pout, vsum4(u0, u1, u2, u3));                                           \
    }
DEFINE_VECTOR(f32, float)
DEFINE_VECTOR(bf16, uint16_t)

static inline float exp_shift(float *x, int64_t n, float top) {
    const vec shift = vset(top);
    vec sum = vzero();
    int64_t l = 0;
    for (; l + LANES <= n; l += LANES) {
        vec e = vexp(vsub(vload(x + l), shift));
        vstore(x + l, e);
        sum = vadd(sum, e);
    }
    float total = vsum(sum);
    for (; l < n; ++l) total += (x[l] = expf(x[l] - top));
    return total;
}

/* silu(x) = x / (1 + exp(-x)), LANES at a time */
static inline vec vsilu(vec x) { return vdiv(x, vadd(vset(1.0f), vexp(vsub(vzero(), x)))); }
#endif

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

/* Its arguments where the build has vectors, nothing where it has none: the
 * vector loop of a kernel, ahead of the plain loop that finishes the row. */
#ifdef LANES
#define WITH_LANES(...) __VA_ARGS__
#else
#define WITH_LANES(...)
#endif

#ifdef LANES

/* One sequence's attention, for one storage type: ELEM is the stored
 * element, SUFFIX names its vector loads, roundings and stores. A slot's
 * K (or V) row holds every KV head, so each row is read once, front to back,
 * for all the heads: one scattered access per slot instead of one per head.
 * Head sizes are a multiple of 16 (the caller checks). */
#define DEFINE_ITEM(SUFFIX, ELEM)                                                              \
    static void item_##SUFFIX(const Job *job, int64_t b, float *qf, float *acc,                \
                              float *scores) {                                                 \
        const int64_t hq = job->hq, hkv = job->hkv, group = hq / hkv, dim = job->dim;          \
        const int64_t width = job->width, len = job->lens[b], row_len = hkv * dim;             \
        const int64_t *slots = job->slots + b * width;                                         \
        const ELEM *q = (const ELEM *)job->q + b * hq * dim;                                   \
        const ELEM *kc = (const ELEM *)job->k, *vc = (const ELEM *)job->v;                     \
        for (int64_t i = 0; i < hq * dim; i += LANES)                                          \
            vstore(qf + i, vmul(vload_##SUFFIX(q + i), vset(job->scale)));                     \
        int64_t l = 0;                                                                         \
        float four[4], next4[4];                                                               \
        for (; l + 4 <= len; l += 4) {                                                         \
            const ELEM *r0 = kc + slots[l] * row_len, *r1 = kc + slots[l + 1] * row_len;       \
            const ELEM *r2 = kc + slots[l + 2] * row_len, *r3 = kc + slots[l + 3] * row_len;   \
            for (int64_t m = 4; m < 4 + AHEAD && l + m < len; ++m)                             \
                prefetch_row(kc + slots[l + m] * row_len, row_len * sizeof(ELEM));             \
            for (int64_t h = 0, i = 0; h < hkv; ++h) {                                         \
                const int64_t at = h * dim;                                                    \
                int64_t j = 0;                                                                 \
                for (; j + 2 <= group; j += 2, i += 2) {                                       \
                    dot4x2_##SUFFIX(qf + i * dim, qf + (i + 1) * dim, r0 + at, r1 + at,        \
                                    r2 + at, r3 + at, dim, four, next4);                       \
                    memcpy(scores + i * width + l, four, sizeof four);                         \
                    memcpy(scores + (i + 1) * width + l, next4, sizeof next4);                 \
                }                                                                              \
                for (; j < group; ++j, ++i) {                                                  \
                    dot4_##SUFFIX(qf + i * dim, r0 + at, r1 + at, r2 + at, r3 + at, dim, four); \
                    memcpy(scores + i * width + l, four, sizeof four);                         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (; l < len; ++l) {                                                                 \
            const ELEM *row = kc + slots[l] * row_len;                                         \
            for (int64_t h = 0, i = 0; h < hkv; ++h)                                           \
                for (int64_t j = 0; j < group; ++j, ++i)                                       \
                    scores[i * width + l] = dot_##SUFFIX(qf + i * dim, row + h * dim, dim);    \
        }                                                                                      \
        for (int64_t i = 0; i < hq; ++i) {                                                     \
            float *si = scores + i * width;                                                    \
            vec tops = vset(-INFINITY);                                                        \
            int64_t l = 0;                                                                     \
            for (; l + LANES <= len; l += LANES) tops = vmax(vload(si + l), tops);             \
            float top = vtop(tops);                                                            \
            for (; l < len; ++l) top = si[l] > top ? si[l] : top;                              \
            const float total = exp_shift(si, len, top);                                       \
            const float inv = len > 0 ? 1.0f / total : 0.0f;                                   \
            for (int64_t l = 0; l < len; ++l) si[l] *= inv;                                    \
        }                                                                                      \
        memset(acc, 0, (size_t)(hq * dim) * sizeof(float));                                   \
        l = 0;                                                                                 \
        for (; l + 4 <= len; l += 4) {                                                         \
            for (int64_t m = 4; m < 4 + AHEAD && l + m < len; ++m)                             \
                prefetch_row(vc + slots[l + m] * row_len, row_len * sizeof(ELEM));             \
            const ELEM *r0 = vc + slots[l] * row_len, *r1 = vc + slots[l + 1] * row_len;       \
            const ELEM *r2 = vc + slots[l + 2] * row_len, *r3 = vc + slots[l + 3] * row_len;   \
            for (int64_t h = 0, at = 0; h < hkv; ++h)                                          \
            for (int64_t d = 0; d < dim; d += LANES, at += LANES) {                            \
                const vec x0 = vload_##SUFFIX(r0 + at), x1 = vload_##SUFFIX(r1 + at);          \
                const vec x2 = vload_##SUFFIX(r2 + at), x3 = vload_##SUFFIX(r3 + at);          \
                for (int64_t i = h * group; i < (h + 1) * group; ++i) {                        \
                    const float *p = scores + i * width + l;                                   \
                    float *a = acc + i * dim + d;                                              \
                    vec sum = vfma(vset(p[0]), x0, vload(a));                                  \
                    sum = vfma(vset(p[1]), x1, sum);                                           \
                    sum = vfma(vset(p[2]), x2, sum);                                           \
                    vstore(a, vfma(vset(p[3]), x3, sum));                                      \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (; l < len; ++l) {                                                                 \
            const ELEM *row = vc + slots[l] * row_len;                                         \
            for (int64_t h = 0, at = 0; h < hkv; ++h)                                          \
            for (int64_t d = 0; d < dim; d += LANES, at += LANES) {                            \
                const vec x = vload_##SUFFIX(row + at);                                        \
                for (int64_t i = h * group; i < (h + 1) * group; ++i) {                        \
                    float *a = acc + i * dim + d;                                              \
                    vstore(a, vfma(vset(scores[i * width + l]), x, vload(a)));                 \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        ELEM *o = (ELEM *)job->out + b * hq * dim;                                             \
        for (int64_t i = 0; i < hq * dim; i += LANES)                                          \
            vstore_##SUFFIX(o + i, vround_##SUFFIX(vload(acc + i)));                           \
    }

DEFINE_ITEM(f32, float)
DEFINE_ITEM(bf16, uint16_t)

static int run_items(Job *job) {
    const int64_t hq = job->hq, dim = job->dim, width = job->width;
    float *qf = malloc((size_t)(hq * dim) * sizeof(float));
    float *acc = malloc((size_t)(hq * dim) * sizeof(float));
    float *scores = malloc((size_t)(hq * (width > 0 ? width : 1)) * sizeof(float));
    if (!qf || !acc || !scores) {
        free(qf), free(acc), free(scores);
        return 1;
    }
    for (int64_t b = job->first; b < job->last; ++b) {
        if (job->dtype == F32)
            item_f32(job, b, qf, acc, scores);
        else
            item_bf16(job, b, qf, acc, scores);
    }
    free(qf), free(acc), free(scores);
    return 0;
}

static void *run_thread(void *arg) {
    Job *job = arg;
    job->status = run_items(job);
    return NULL;
}

/* Returns 0 on success, 1 when memory ran out, 2 when a thread could not
 * start, BAD_SLOT when a context length exceeds the width or a context slot
 * lies outside the pool of `capacity` rows (3: built without vectors,
 * below). */
int decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *req_slots, const int64_t *seq_lens, int64_t batch,
                     int64_t width, int64_t hq, int64_t hkv, int64_t dim, int64_t dtype,
                     float scale, int64_t threads, int64_t capacity) {
    for (int64_t b = 0; b < batch; ++b)
        if (seq_lens[b] < 0 || seq_lens[b] > width ||
            !slots_in_pool(req_slots + b * width, seq_lens[b], capacity))
            return BAD_SLOT;
    if (threads < 1) threads = 1;
    if (threads > batch) threads = batch > 0 ? batch : 1;
    Job jobs[threads];
    pthread_t ids[threads];
    int started[threads];
    for (int64_t t = 0; t < threads; ++t) {
        jobs[t] = (Job){q, k_cache, v_cache, out, req_slots, seq_lens, width, hq, hkv, dim,
                        dtype, scale, batch * t / threads, batch * (t + 1) / threads, 0};
        started[t] = 0;
    }
    int status = 0;
    for (int64_t t = 1; t < threads; ++t) {
        if (pthread_create(&ids[t], NULL, run_thread, &jobs[t]) == 0)
            started[t] = 1;
        else
            status = 2;
    }
    jobs[0].status = run_items(&jobs[0]);
    for (int64_t t = 1; t < threads; ++t) {
        if (started[t]) pthread_join(ids[t], NULL);
        if (jobs[t].status) status = jobs[t].status;
    }
    if (jobs[0].status) status = jobs[0].status;
    return status;
}

#else
/* Built for a target with neither vector set: `vectorized` says 0 and the
 * caller never attends here. */
int decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *req_slots, const int64_t *seq_lens, int64_t batch,
                     int64_t width, int64_t hq, int64_t hkv, int64_t dim, int64_t dtype,
                     float scale, int64_t threads, int64_t capacity) {
    (void)q, (void)k_cache, (void)v_cache, (void)out, (void)req_slots, (void)seq_lens;
    (void)batch, (void)width, (void)hq, (void)hkv, (void)dim, (void)dtype, (void)scale;
    (void)threads, (void)capacity;
    return 3;
}
#endif

/* Per row of n: summed = x + residual, rounded to the storage type (only
 * when residual is given), then out = weight * round(summed / rms(summed)),
 * the rms in float32: the reference's `weight * rms_norm(x)`, whose product
 * is taken (and rounded) in the storage type. `row` is n floats of scratch.
 * LANES at a time, then one at a time for what the lanes leave. */
#define DEFINE_NORM(SUFFIX, ELEM, LOAD, STORE)                                                \
    static void norm_##SUFFIX(const ELEM *x, const ELEM *residual, const ELEM *weight,        \
                              ELEM *out, ELEM *summed, int64_t rows, int64_t n, float eps,    \
                              float *row) {                                                   \
        for (int64_t r = 0; r < rows; ++r) {                                                  \
            const ELEM *xr = x + r * n, *rr = residual ? residual + r * n : NULL;             \
            ELEM *sr = residual ? summed + r * n : NULL;                                      \
            float squares = 0.0f;                                                             \
            int64_t i = 0;                                                                    \
            WITH_LANES(                                                                       \
                vec sq = vzero();                                                             \
                for (; i + LANES <= n; i += LANES) {                                          \
                    vec v = vload_##SUFFIX(xr + i);                                           \
                    if (rr) {                                                                 \
                        v = vround_##SUFFIX(vadd(v, vload_##SUFFIX(rr + i)));                 \
                        vstore_##SUFFIX(sr + i, v);                                           \
                    }                                                                         \
                    vstore(row + i, v);                                                       \
                    sq = vfma(v, v, sq);                                                      \
                }                                                                             \
                squares = vsum(sq);)                                                          \
            for (; i < n; ++i) {                                                              \
                row[i] = rr ? LOAD(sr[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]))) : LOAD(xr[i]);   \
                squares += row[i] * row[i];                                                   \
            }                                                                                 \
            const float inv = 1.0f / sqrtf(squares / (float)n + eps);                         \
            ELEM *o = out + r * n;                                                            \
            i = 0;                                                                            \
            WITH_LANES(for (; i + LANES <= n; i += LANES) {                                   \
                const vec t = vround_##SUFFIX(vmul(vload(row + i), vset(inv)));               \
                vstore_##SUFFIX(o + i, vround_##SUFFIX(vmul(t, vload_##SUFFIX(weight + i)))); \
            })                                                                                \
            for (; i < n; ++i) o[i] = STORE(LOAD(STORE(row[i] * inv)) * LOAD(weight[i]));     \
        }                                                                                     \
    }

DEFINE_NORM(f32, float, F32_LOAD, F32_STORE)
DEFINE_NORM(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Returns 0 on success, 1 when memory ran out. `residual` and `summed` may
 * be NULL (a norm with no add). */
int add_rmsnorm(const void *x, const void *residual, const void *weight, void *out, void *summed,
                int64_t rows, int64_t n, float eps, int64_t dtype) {
    float *row = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!row) return 1;
    if (dtype == F32)
        norm_f32(x, residual, weight, out, summed, rows, n, eps, row);
    else
        norm_bf16(x, residual, weight, out, summed, rows, n, eps, row);
    free(row);
    return 0;
}

static inline float silu1(float x) { return x / (1.0f + expf(-x)); }

/* Per row: out[0:n] = round(round(silu(gate)) * up), gate = row[0:n], up = row[n:2n],
 * LANES at a time, then one at a time for what the lanes leave. */
#define DEFINE_SILU_MUL(SUFFIX, ELEM, LOAD, STORE)                                            \
    static void silu_mul_##SUFFIX(const ELEM *gate_up, ELEM *out, int64_t rows, int64_t n) {  \
        for (int64_t r = 0; r < rows; ++r) {                                                  \
            const ELEM *g = gate_up + r * 2 * n, *u = g + n;                                  \
            ELEM *o = out + r * n;                                                            \
            int64_t i = 0;                                                                    \
            WITH_LANES(for (; i + LANES <= n; i += LANES) {                                   \
                const vec s = vround_##SUFFIX(vsilu(vload_##SUFFIX(g + i)));                  \
                vstore_##SUFFIX(o + i, vround_##SUFFIX(vmul(s, vload_##SUFFIX(u + i))));      \
            })                                                                                \
            for (; i < n; ++i) o[i] = STORE(LOAD(STORE(silu1(LOAD(g[i])))) * LOAD(u[i]));     \
        }                                                                                     \
    }

DEFINE_SILU_MUL(f32, float, F32_LOAD, F32_STORE)
DEFINE_SILU_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Returns 0 (the status is kept for the caller's one check). */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int64_t dtype) {
    if (dtype == F32)
        silu_mul_f32(gate_up, out, rows, n);
    else
        silu_mul_bf16(gate_up, out, rows, n);
    return 0;
}

/* Per token t: x * cos + roll(x, D/2) * signed_sin, for its Hq query heads
 * (to q_out [T, Hq, D]) and Hkv key heads (to k_cache[slots[t]]); its Hkv
 * value heads are copied to v_cache[slots[t]]. Rounds as torch's
 * roll(x).mul_(sin).addcmul_(x, cos): the product by sin once, the sum once.
 * `qk` and `v` rows are `qk_stride` and `v_stride` elements apart. LANES at
 * a time where a half of a head is a multiple of the lanes. */
#define DEFINE_ROPE(SUFFIX, ELEM, LOAD, STORE)                                                \
    static void rope_##SUFFIX(const ELEM *qk, int64_t qk_stride, const ELEM *v,               \
                              int64_t v_stride, const ELEM *cos, const ELEM *sin,             \
                              ELEM *q_out, ELEM *k_cache, ELEM *v_cache,                      \
                              const int64_t *slots, int64_t tokens, int64_t hq, int64_t hkv,  \
                              int64_t dim) {                                                  \
        const int64_t half = dim / 2;                                                         \
        for (int64_t t = 0; t < tokens; ++t) {                                                \
            const ELEM *c = cos + t * dim, *s = sin + t * dim;                                \
            for (int64_t h = 0; h < hq + hkv; ++h) {                                          \
                const ELEM *x = qk + t * qk_stride + h * dim;                                 \
                ELEM *o = h < hq ? q_out + (t * hq + h) * dim                                 \
                                 : k_cache + (slots[t] * hkv + (h - hq)) * dim;               \
                int64_t d = 0;                                                                \
                WITH_LANES(if (half % LANES == 0) for (; d < dim; d += LANES) {               \
                    const ELEM *rolled = x + (d < half ? d + half : d - half);                \
                    const vec turned =                                                        \
                        vround_##SUFFIX(vmul(vload_##SUFFIX(rolled), vload_##SUFFIX(s + d))); \
                    const vec sum = vfma(vload_##SUFFIX(x + d), vload_##SUFFIX(c + d), turned); \
                    vstore_##SUFFIX(o + d, vround_##SUFFIX(sum));                             \
                })                                                                            \
                for (; d < dim; ++d) {                                                        \
                    const float rolled = LOAD(x[d < half ? d + half : d - half]);             \
                    const float turned = LOAD(STORE(rolled * LOAD(s[d])));                    \
                    o[d] = STORE(turned + LOAD(x[d]) * LOAD(c[d]));                           \
                }                                                                             \
            }                                                                                 \
            memcpy(v_cache + slots[t] * hkv * dim, v + t * v_stride,                          \
                   (size_t)(hkv * dim) * sizeof(ELEM));                                       \
        }                                                                                     \
    }

DEFINE_ROPE(f32, float, F32_LOAD, F32_STORE)
DEFINE_ROPE(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Returns 0, or BAD_SLOT (having written nothing) when a slot lies outside
 * the pool of `capacity` rows. */
int rope_store(const void *qk, int64_t qk_stride, const void *v, int64_t v_stride,
               const void *cos, const void *sin, void *q_out, void *k_cache, void *v_cache,
               const int64_t *slots, int64_t tokens, int64_t hq, int64_t hkv, int64_t dim,
               int64_t dtype, int64_t capacity) {
    if (!slots_in_pool(slots, tokens, capacity)) return BAD_SLOT;
    if (dtype == F32)
        rope_f32(qk, qk_stride, v, v_stride, cos, sin, q_out, k_cache, v_cache, slots, tokens, hq,
                 hkv, dim);
    else
        rope_bf16(qk, qk_stride, v, v_stride, cos, sin, q_out, k_cache, v_cache, slots, tokens,
                  hq, hkv, dim);
    return 0;
}

/* The vector width compiled in (16: AVX-512, 8: AVX2), 0 for none: the
 * plain loops are slower than torch's own ops, so the caller keeps those. */
int vectorized(void) {
#ifdef LANES
    return LANES;
#else
    return 0;
#endif
}
