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
    int64_t batch, width, hq, hkv, dim, dtype;
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

/* The three primitives, per storage type: a dot product of a float query
 * with a stored row, acc += p * row, and x = exp(x - top) returning the sum.
 * With AVX-512 (and rows a multiple of 16 long) they run 16 lanes at a time;
 * otherwise as plain loops. */
#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The four sums of four vectors' lanes, as one 4-lane vector. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then the same for c, d */
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: [a, b, c, d] summed over the lane */
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    /* then over the four 128-bit lanes */
    abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(1, 0, 3, 2)));
    abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(abcd);
}

#define DEFINE_VECTOR(SUFFIX, ELEM)                                                           \
    static inline float dot_##SUFFIX(const float *q, const ELEM *k, int64_t n) {              \
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();                              \
        int64_t d = 0;                                                                        \
        for (; d + 32 <= n; d += 32) {                                                        \
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##SUFFIX(k + d), a);          \
            b = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), load16_##SUFFIX(k + d + 16), b); \
        }                                                                                     \
        for (; d < n; d += 16)                                                                \
            a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_##SUFFIX(k + d), a);          \
        return _mm512_reduce_add_ps(_mm512_add_ps(a, b));                                     \
    }                                                                                         \
    /* out[0:4] = the dot products of q with four rows, reduced together */                \
    static inline void dot4_##SUFFIX(const float *q, const ELEM *k0, const ELEM *k1,          \
                                     const ELEM *k2, const ELEM *k3, int64_t n, float *out) { \
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;                           \
        for (int64_t d = 0; d < n; d += 16) {                                                 \
            const __m512 qd = _mm512_loadu_ps(q + d);                                         \
            t0 = _mm512_fmadd_ps(qd, load16_##SUFFIX(k0 + d), t0);                            \
            t1 = _mm512_fmadd_ps(qd, load16_##SUFFIX(k1 + d), t1);                            \
            t2 = _mm512_fmadd_ps(qd, load16_##SUFFIX(k2 + d), t2);                            \
            t3 = _mm512_fmadd_ps(qd, load16_##SUFFIX(k3 + d), t3);                            \
        }                                                                                     \
        _mm_storeu_ps(out, reduce4(t0, t1, t2, t3));                                          \
    }                                                                                         \
    /* out[0:n] = sum over l of p[l] * rows[slots[l]][0:n], 64 lanes at a time in registers */ \
    static inline void weigh_##SUFFIX(float *out, const float *p, const ELEM *base,            \
                                      const int64_t *slots, int64_t len, int64_t row_len,      \
                                      int64_t n) {                                            \
        for (int64_t c = 0; c < n; c += 64) {                                                 \
            const int64_t lanes = n - c < 64 ? n - c : 64;                                    \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                       \
            for (int64_t l = 0; l < len; ++l) {                                               \
                const ELEM *v = base + slots[l] * row_len + c;                                \
                const __m512 w = _mm512_set1_ps(p[l]);                                        \
                a0 = _mm512_fmadd_ps(w, load16_##SUFFIX(v), a0);                              \
                if (lanes > 16) a1 = _mm512_fmadd_ps(w, load16_##SUFFIX(v + 16), a1);         \
                if (lanes > 32) a2 = _mm512_fmadd_ps(w, load16_##SUFFIX(v + 32), a2);         \
                if (lanes > 48) a3 = _mm512_fmadd_ps(w, load16_##SUFFIX(v + 48), a3);         \
            }                                                                                 \
            _mm512_storeu_ps(out + c, a0);                                                    \
            if (lanes > 16) _mm512_storeu_ps(out + c + 16, a1);                               \
            if (lanes > 32) _mm512_storeu_ps(out + c + 32, a2);                               \
            if (lanes > 48) _mm512_storeu_ps(out + c + 48, a3);                               \
        }                                                                                     \
    }
DEFINE_VECTOR(f32, float)
DEFINE_VECTOR(bf16, uint16_t)

/* exp(x) = 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2], p of degree 6
 * (relative error about 2e-7); below -87 it is 0, above 88 infinity, and a
 * NaN stays NaN. */
static inline __m512 exp16(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2 = _mm512_set1_ps(0.693147180559945309f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* the second operand, x, when it is NaN */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, ln2, x);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

static inline float exp_shift(float *x, int64_t n, float top) {
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    int64_t l = 0;
    for (; l + 16 <= n; l += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + l), shift));
        _mm512_storeu_ps(x + l, e);
        total = _mm512_add_ps(total, e);
    }
    if (l < n) {
        __mmask16 rest = (__mmask16)((1u << (n - l)) - 1u);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, x + l), shift));
        e = _mm512_maskz_mov_ps(rest, e);
        _mm512_mask_storeu_ps(x + l, rest, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}
#define VECTOR_ROWS(dim) ((dim) % 16 == 0)

/* silu(x) = x / (1 + exp(-x)) for 16 lanes */
static inline __m512 silu16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(one, e));
}
#else
#define DEFINE_VECTOR(SUFFIX, ELEM)                                                           \
    static inline float dot_##SUFFIX(const float *q, const ELEM *k, int64_t n) {              \
        (void)q, (void)k, (void)n;                                                            \
        return 0.0f;                                                                          \
    }                                                                                         \
    static inline void dot4_##SUFFIX(const float *q, const ELEM *k0, const ELEM *k1,          \
                                     const ELEM *k2, const ELEM *k3, int64_t n, float *out) { \
        (void)q, (void)k0, (void)k1, (void)k2, (void)k3, (void)n, (void)out;                  \
    }                                                                                         \
    static inline void weigh_##SUFFIX(float *out, const float *p, const ELEM *base,            \
                                      const int64_t *slots, int64_t len, int64_t row_len,      \
                                      int64_t n) {                                            \
        (void)out, (void)p, (void)base, (void)slots, (void)len, (void)row_len, (void)n;       \
    }
DEFINE_VECTOR(f32, float)
DEFINE_VECTOR(bf16, uint16_t)

static inline float exp_shift(float *x, int64_t n, float top) {
    float total = 0.0f;
    for (int64_t l = 0; l < n; ++l) total += (x[l] = expf(x[l] - top));
    return total;
}
#define VECTOR_ROWS(dim) 0
#endif

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

/* One sequence's attention, for one storage type: ELEM is the stored
 * element, LOAD turns one into a float, STORE writes a float back. A slot's
 * K (or V) row holds every KV head, so each row is read once, front to back,
 * for all the heads: one scattered access per slot instead of one per head. */
#define DEFINE_ITEM(SUFFIX, ELEM, LOAD, STORE)                                                \
    static void item_##SUFFIX(const Job *job, int64_t b, float *qf, float *acc,               \
                              float *scores) {                                                \
        const int64_t hq = job->hq, hkv = job->hkv, group = hq / hkv, dim = job->dim;         \
        const int64_t width = job->width, len = job->lens[b], row_len = hkv * dim;            \
        const int64_t *slots = job->slots + b * width;                                        \
        const int vector = VECTOR_ROWS(dim);                                                  \
        const ELEM *q = (const ELEM *)job->q + b * hq * dim;                                  \
        const ELEM *kc = (const ELEM *)job->k, *vc = (const ELEM *)job->v;                    \
        for (int64_t i = 0; i < hq * dim; ++i) qf[i] = LOAD(q[i]) * job->scale;               \
        int64_t l = 0;                                                                        \
        if (vector) {                                                                         \
            float four[4];                                                                    \
            for (; l + 4 <= len; l += 4) {                                                    \
                const ELEM *r0 = kc + slots[l] * row_len, *r1 = kc + slots[l + 1] * row_len;  \
                const ELEM *r2 = kc + slots[l + 2] * row_len, *r3 = kc + slots[l + 3] * row_len; \
                for (int64_t m = 4; m < 4 + AHEAD && l + m < len; ++m)                        \
                    prefetch_row(kc + slots[l + m] * row_len, row_len * sizeof(ELEM));        \
                for (int64_t h = 0, i = 0; h < hkv; ++h) {                                    \
                    const int64_t at = h * dim;                                               \
                    for (int64_t j = 0; j < group; ++j, ++i) {                                \
                        dot4_##SUFFIX(qf + i * dim, r0 + at, r1 + at, r2 + at, r3 + at, dim,  \
                                      four);                                                  \
                        memcpy(scores + i * width + l, four, sizeof four);                    \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (; l < len; ++l) {                                                                \
            const ELEM *row = kc + slots[l] * row_len;                                        \
            for (int64_t h = 0, i = 0; h < hkv; ++h) {                                        \
                const ELEM *k = row + h * dim;                                                \
                for (int64_t j = 0; j < group; ++j, ++i) {                                    \
                    const float *qi = qf + i * dim;                                           \
                    float s = 0.0f;                                                           \
                    if (vector) {                                                             \
                        s = dot_##SUFFIX(qi, k, dim);                                         \
                    } else {                                                                  \
                        for (int64_t d = 0; d < dim; ++d) s += qi[d] * LOAD(k[d]);            \
                    }                                                                         \
                    scores[i * width + l] = s;                                                \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t i = 0; i < hq; ++i) {                                                    \
            float *si = scores + i * width;                                                   \
            float top = -INFINITY;                                                            \
            for (int64_t l = 0; l < len; ++l) top = si[l] > top ? si[l] : top;                \
            const float total = exp_shift(si, len, top);                                      \
            const float inv = len > 0 ? 1.0f / total : 0.0f;                                  \
            for (int64_t l = 0; l < len; ++l) si[l] *= inv;                                   \
        }                                                                                     \
        for (int64_t h = 0, i = 0; h < hkv; ++h) {                                            \
            for (int64_t j = 0; j < group; ++j, ++i) {                                        \
                const float *p = scores + i * width;                                          \
                float *ai = acc + i * dim;                                                    \
                if (vector) {                                                                 \
                    weigh_##SUFFIX(ai, p, vc + h * dim, slots, len, row_len, dim);            \
                    continue;                                                                 \
                }                                                                             \
                memset(ai, 0, (size_t)dim * sizeof(float));                                   \
                for (int64_t l = 0; l < len; ++l) {                                           \
                    const ELEM *v = vc + slots[l] * row_len + h * dim;                        \
                    for (int64_t d = 0; d < dim; ++d) ai[d] += p[l] * LOAD(v[d]);             \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        ELEM *o = (ELEM *)job->out + b * hq * dim;                                            \
        for (int64_t i = 0; i < hq * dim; ++i) o[i] = STORE(acc[i]);                          \
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

/* Returns 0 on success, 1 when memory ran out, 2 when a thread could not start. */
int decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int64_t *req_slots, const int64_t *seq_lens, int64_t batch,
                     int64_t width, int64_t hq, int64_t hkv, int64_t dim, int64_t dtype,
                     float scale, int64_t threads) {
    const int64_t items = batch;
    if (threads < 1) threads = 1;
    if (threads > items) threads = items > 0 ? items : 1;
    Job jobs[threads];
    pthread_t ids[threads];
    int started[threads];
    for (int64_t t = 0; t < threads; ++t) {
        jobs[t] = (Job){q, k_cache, v_cache, out, req_slots, seq_lens, batch, width, hq, hkv,
                        dim, dtype, scale, items * t / threads, items * (t + 1) / threads, 0};
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

/* The sum of squares of n floats. */
static inline float sum_squares(const float *x, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            a = _mm512_fmadd_ps(v, v, a);
        }
        return _mm512_reduce_add_ps(a);
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

#ifdef __AVX512F__
#define SILU_LANES(x, n, i)                                                                   \
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, silu16(_mm512_loadu_ps(x + i)))
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

/* 1 when the 16-lane primitives were compiled in (the plain loops are
 * slower than torch's gather-and-SDPA path, so the caller keeps that). */
int vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
