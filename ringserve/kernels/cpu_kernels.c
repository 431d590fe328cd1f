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

/* The vector primitives, per storage type: a dot product of a float query
 * with a stored row (dot, and dot4 for four rows at once), the weighted sum
 * of rows (weigh), x = exp(x - top) returning the sum (exp_shift), and silu.
 * They are written once over `vec`, LANES floats wide: 16 with AVX-512, 8
 * with AVX2 and FMA. Decode attention needs them (head sizes a multiple of
 * 16); the norm and silu run plain loops over what the lanes leave, and
 * alone in a build for a CPU with neither. */
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
    /* out[0:n] = sum over l of p[l] * rows[slots[l]][0:n], 4 x LANES at a time in registers */ \
    static inline void weigh_##SUFFIX(float *out, const float *p, const ELEM *base,            \
                                      const int64_t *slots, int64_t len, int64_t row_len,      \
                                      int64_t n) {                                            \
        for (int64_t c = 0; c < n; c += 4 * LANES) {                                          \
            const int64_t lanes = n - c < 4 * LANES ? n - c : 4 * LANES;                      \
            vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;                                      \
            for (int64_t l = 0; l < len; ++l) {                                               \
                const ELEM *v = base + slots[l] * row_len + c;                                \
                const vec w = vset(p[l]);                                                     \
                a0 = vfma(w, vload_##SUFFIX(v), a0);                                          \
                if (lanes > LANES) a1 = vfma(w, vload_##SUFFIX(v + LANES), a1);               \
                if (lanes > 2 * LANES) a2 = vfma(w, vload_##SUFFIX(v + 2 * LANES), a2);       \
                if (lanes > 3 * LANES) a3 = vfma(w, vload_##SUFFIX(v + 3 * LANES), a3);       \
            }                                                                                 \
            vstore(out + c, a0);                                                              \
            if (lanes > LANES) vstore(out + c + LANES, a1);                                   \
            if (lanes > 2 * LANES) vstore(out + c + 2 * LANES, a2);                           \
            if (lanes > 3 * LANES) vstore(out + c + 3 * LANES, a3);                           \
        }                                                                                     \
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

#ifdef LANES

/* One sequence's attention, for one storage type: ELEM is the stored
 * element, LOAD turns one into a float, STORE writes a float back. A slot's
 * K (or V) row holds every KV head, so each row is read once, front to back,
 * for all the heads: one scattered access per slot instead of one per head.
 * Head sizes are a multiple of 16 (the caller checks). */
#define DEFINE_ITEM(SUFFIX, ELEM, LOAD, STORE)                                                 \
    static void item_##SUFFIX(const Job *job, int64_t b, float *qf, float *acc,                \
                              float *scores) {                                                 \
        const int64_t hq = job->hq, hkv = job->hkv, group = hq / hkv, dim = job->dim;          \
        const int64_t width = job->width, len = job->lens[b], row_len = hkv * dim;             \
        const int64_t *slots = job->slots + b * width;                                         \
        const ELEM *q = (const ELEM *)job->q + b * hq * dim;                                   \
        const ELEM *kc = (const ELEM *)job->k, *vc = (const ELEM *)job->v;                     \
        for (int64_t i = 0; i < hq * dim; ++i) qf[i] = LOAD(q[i]) * job->scale;                \
        int64_t l = 0;                                                                         \
        float four[4];                                                                         \
        for (; l + 4 <= len; l += 4) {                                                         \
            const ELEM *r0 = kc + slots[l] * row_len, *r1 = kc + slots[l + 1] * row_len;       \
            const ELEM *r2 = kc + slots[l + 2] * row_len, *r3 = kc + slots[l + 3] * row_len;   \
            for (int64_t m = 4; m < 4 + AHEAD && l + m < len; ++m)                             \
                prefetch_row(kc + slots[l + m] * row_len, row_len * sizeof(ELEM));             \
            for (int64_t h = 0, i = 0; h < hkv; ++h) {                                         \
                const int64_t at = h * dim;                                                    \
                for (int64_t j = 0; j < group; ++j, ++i) {                                     \
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
            float top = -INFINITY;                                                             \
            for (int64_t l = 0; l < len; ++l) top = si[l] > top ? si[l] : top;                 \
            const float total = exp_shift(si, len, top);                                       \
            const float inv = len > 0 ? 1.0f / total : 0.0f;                                   \
            for (int64_t l = 0; l < len; ++l) si[l] *= inv;                                    \
        }                                                                                      \
        for (int64_t h = 0, i = 0; h < hkv; ++h)                                               \
            for (int64_t j = 0; j < group; ++j, ++i)                                           \
                weigh_##SUFFIX(acc + i * dim, scores + i * width, vc + h * dim, slots, len,    \
                               row_len, dim);                                                  \
        ELEM *o = (ELEM *)job->out + b * hq * dim;                                             \
        for (int64_t i = 0; i < hq * dim; ++i) o[i] = STORE(acc[i]);                           \
    }

DEFINE_ITEM(f32, float, F32_LOAD, F32_STORE)
DEFINE_ITEM(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

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
 * start (3: built without vectors, below). */
int decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *req_slots, const int64_t *seq_lens, int64_t batch,
                     int64_t width, int64_t hq, int64_t hkv, int64_t dim, int64_t dtype,
                     float scale, int64_t threads) {
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
                     float scale, int64_t threads) {
    (void)q, (void)k_cache, (void)v_cache, (void)out, (void)req_slots, (void)seq_lens;
    (void)batch, (void)width, (void)hq, (void)hkv, (void)dim, (void)dtype, (void)scale;
    (void)threads;
    return 3;
}
#endif

/* The sum of squares of n floats. */
static inline float sum_squares(const float *x, int64_t n) {
#ifdef LANES
    if (n % LANES == 0) {
        vec a = vzero();
        for (int64_t i = 0; i < n; i += LANES) {
            vec v = vload(x + i);
            a = vfma(v, v, a);
        }
        return vsum(a);
    }
#endif
    float total = 0.0f;
    for (int64_t i = 0; i < n; ++i) total += x[i] * x[i];
    return total;
}

/* Per row of n: summed = x + residual, rounded to the storage type (only
 * when residual is given), then out = weight * round(summed / rms(summed)),
 * the rms in float32: the reference's `weight * rms_norm(x)`, whose product
 * is taken (and rounded) in the storage type. `row` is n floats of scratch. */
#define DEFINE_NORM(SUFFIX, ELEM, LOAD, STORE)                                                \
    static void norm_##SUFFIX(const ELEM *x, const ELEM *residual, const ELEM *weight,        \
                              ELEM *out, ELEM *summed, int64_t rows, int64_t n, float eps,    \
                              float *row) {                                                   \
        for (int64_t r = 0; r < rows; ++r) {                                                  \
            const ELEM *xr = x + r * n;                                                       \
            if (residual) {                                                                   \
                const ELEM *rr = residual + r * n;                                            \
                ELEM *sr = summed + r * n;                                                    \
                for (int64_t i = 0; i < n; ++i) {                                             \
                    sr[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]));                                 \
                    row[i] = LOAD(sr[i]);                                                     \
                }                                                                             \
            } else {                                                                          \
                for (int64_t i = 0; i < n; ++i) row[i] = LOAD(xr[i]);                         \
            }                                                                                 \
            const float inv = 1.0f / sqrtf(sum_squares(row, n) / (float)n + eps);             \
            ELEM *o = out + r * n;                                                            \
            for (int64_t i = 0; i < n; ++i) o[i] = STORE(LOAD(STORE(row[i] * inv)) * LOAD(weight[i])); \
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

/* Per row: out[0:n] = round(round(silu(gate)) * up), gate = row[0:n], up = row[n:2n]. */
#define DEFINE_SILU_MUL(SUFFIX, ELEM, LOAD, STORE)                                            \
    static void silu_mul_##SUFFIX(const ELEM *gate_up, ELEM *out, int64_t rows, int64_t n,    \
                                  float *scratch) {                                           \
        for (int64_t r = 0; r < rows; ++r) {                                                  \
            const ELEM *g = gate_up + r * 2 * n, *u = g + n;                                  \
            ELEM *o = out + r * n;                                                            \
            int64_t i = 0;                                                                    \
            for (; i < n; ++i) scratch[i] = LOAD(g[i]);                                       \
            i = 0;                                                                            \
            SILU_LANES(scratch, n, i);                                                        \
            for (; i < n; ++i) scratch[i] = silu1(scratch[i]);                                \
            for (i = 0; i < n; ++i) o[i] = STORE(LOAD(STORE(scratch[i])) * LOAD(u[i]));       \
        }                                                                                     \
    }

#ifdef LANES
#define SILU_LANES(x, n, i) for (; i + LANES <= n; i += LANES) vstore(x + i, vsilu(vload(x + i)))
#else
#define SILU_LANES(x, n, i) (void)0
#endif

DEFINE_SILU_MUL(f32, float, F32_LOAD, F32_STORE)
DEFINE_SILU_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Returns 0 on success, 1 when memory ran out. */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int64_t dtype) {
    float *scratch = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!scratch) return 1;
    if (dtype == F32)
        silu_mul_f32(gate_up, out, rows, n, scratch);
    else
        silu_mul_bf16(gate_up, out, rows, n, scratch);
    free(scratch);
    return 0;
}

/* Per token t: x * cos + roll(x, D/2) * signed_sin, for its Hq query heads
 * (to q_out [T, Hq, D]) and Hkv key heads (to k_cache[slots[t]]); its Hkv
 * value heads are copied to v_cache[slots[t]]. Rounds as torch's
 * roll(x).mul_(sin).addcmul_(x, cos): the product by sin once, the sum once.
 * `qk` and `v` rows are `qk_stride` and `v_stride` elements apart. */
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
                for (int64_t d = 0; d < dim; ++d) {                                           \
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

void rope_store(const void *qk, int64_t qk_stride, const void *v, int64_t v_stride,
                const void *cos, const void *sin, void *q_out, void *k_cache, void *v_cache,
                const int64_t *slots, int64_t tokens, int64_t hq, int64_t hkv, int64_t dim,
                int64_t dtype) {
    if (dtype == F32)
        rope_f32(qk, qk_stride, v, v_stride, cos, sin, q_out, k_cache, v_cache, slots, tokens, hq,
                 hkv, dim);
    else
        rope_bf16(qk, qk_stride, v, v_stride, cos, sin, q_out, k_cache, v_cache, slots, tokens,
                  hq, hkv, dim);
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
