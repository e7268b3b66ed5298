/* Routed experts of one MoE layer for CPUs: mlx-lm's SwitchGLU (gate and up projections,
 * SwiGLU, down projection) over MLX's affine-quantized weights, for a list of
 * (token, expert) pairs, in one call (loaded by metal/experts_cpu.py through ctypes; built by
 * setup.py as metal._experts_cpu). The same row dots compute one dense quantized projection
 * (moe_quantized_linear, for core's attention projections: metal/linear_cpu.py).
 *
 * Why: MLX's CPU backend computes a quantized matmul one scalar multiply-add at a time
 * (a strict float sum, no SIMD), so a one-token layer of a small model spends milliseconds
 * there while the weights stream through the cache at a fraction of memory bandwidth. Expert
 * workers on CPUs (a Linux box with a lot of RAM serving experts, ktransformers-style) live on
 * exactly that operation. Here each weight row is unpacked once per block of up to four pairs
 * that use the same expert and multiplied with 8-wide fused multiply-adds (AVX2 where the CPU
 * has it, plain C elsewhere).
 *
 * Numbers: per quantization group g of a row, w = scale_g * q + bias_g, so
 *   dot(w, x) = sum_g scale_g * dot(q_g, x_g) + bias_g * sum(x_g)
 * accumulated in float32 (MLX's CPU kernel sums the same terms in another order: results agree
 * to float32 rounding, ~1e-6 relative). Where the layer computes in float16 or bfloat16, the
 * projections' outputs and the activation's steps are rounded to that type where MLX rounds
 * them, and the output is written in it.
 *
 * Layouts are MLX's: weight uint32 [E, O, I * bits / 32] (element j of a row at bits
 * (j % per_word) * bits of word j / per_word, little end first), scales and biases
 * [E, O, I / group_size] in float32, float16 or bfloat16.
 */
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_float.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EX_X86 1
#else
#define EX_X86 0
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
#define BLOCK 4        /* pairs sharing one unpacked weight row */
#define MAX_GROUPS 4096 /* in_dim / group_size of one row */

typedef struct {
    const uint32_t *w;
    const void *scales;
    const void *biases;
    int out_dim, in_dim, bits, group_size, scale_dtype;
} proj_t;

static inline float load_as_float(const void *p, size_t i, int dtype) {
    switch (dtype) {
    case DT_F16: return half_to_float(((const uint16_t *)p)[i]);
    case DT_BF16: return bf16_to_float(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline float round_to(float v, int dtype) { /* the value MLX holds in `dtype` */
    switch (dtype) {
    case DT_F16: return half_to_float(float_to_half(v));
    case DT_BF16: return bf16_to_float(float_to_bf16(v));
    default: return v;
    }
}

static inline void store_as(void *p, size_t i, float v, int dtype) {
    switch (dtype) {
    case DT_F16: ((uint16_t *)p)[i] = float_to_half(v); break;
    case DT_BF16: ((uint16_t *)p)[i] = float_to_bf16(v); break;
    default: ((float *)p)[i] = v;
    }
}

/* x [n, width] in `dtype` as float32 rows (xf), and each row's sums per group of `group` (xsum
 * [n, width / group]): the row dots take the bias term of a group as bias * sum(x_g). */
static void rows_as_float(const void *x, int dtype, int n, int width, int group, float *xf, float *xsum) {
    int groups = width / group;
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < width; j++) xf[(size_t)t * width + j] = load_as_float(x, (size_t)t * width + j, dtype);
        for (int g = 0; g < groups; g++) {
            float s = 0.f;
            for (int j = 0; j < group; j++) s += xf[(size_t)t * width + g * group + j];
            xsum[(size_t)t * groups + g] = s;
        }
    }
}

/* ---- one weight row against NB input rows ------------------------------------------ */

/* y[r] = dot(row o of expert e, x[r]) for r < nb. xsum[r][g] is the sum of x[r]'s group g. */
typedef void (*row_dot_fn)(const proj_t *p, size_t row, int nb, const float *const *x,
                           const float *const *xsum, float *y);

static inline void row_scales(const proj_t *p, size_t row, float *scale, float *bias) {
    int groups = p->in_dim / p->group_size;
    size_t base = row * (size_t)groups;
    for (int g = 0; g < groups; g++) {
        scale[g] = load_as_float(p->scales, base + g, p->scale_dtype);
        bias[g] = load_as_float(p->biases, base + g, p->scale_dtype);
    }
}

static void row_dot_scalar(const proj_t *p, size_t row, int nb, const float *const *x,
                           const float *const *xsum, float *y) {
    float scale[MAX_GROUPS], bias[MAX_GROUPS];
    row_scales(p, row, scale, bias);
    int bits = p->bits, per_word = 32 / bits, groups = p->in_dim / p->group_size;
    uint32_t mask = (1u << bits) - 1u;
    const uint32_t *w = p->w + row * (size_t)(p->in_dim / per_word);
    for (int r = 0; r < nb; r++) {
        float total = 0.f;
        for (int g = 0; g < groups; g++) {
            float acc = 0.f;
            const float *xg = x[r] + (size_t)g * p->group_size;
            const uint32_t *wg = w + (size_t)g * (p->group_size / per_word);
            for (int k = 0; k < p->group_size / per_word; k++) {
                uint32_t word = wg[k];
                for (int j = 0; j < per_word; j++) acc += (float)((word >> (j * bits)) & mask) * xg[k * per_word + j];
            }
            total += scale[g] * acc + bias[g] * xsum[r][g];
        }
        y[r] = total;
    }
}

#if EX_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* The eight quantized values starting at element j of the row (j a multiple of 8), as floats. */
AVX2 static inline __m256 unpack8(const uint32_t *w, int j, int bits) {
    if (bits == 4) {
        __m256i word = _mm256_set1_epi32((int)w[j >> 3]);
        __m256i q = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                     _mm256_set1_epi32(0xf));
        return _mm256_cvtepi32_ps(q);
    }
    if (bits == 8) {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)(w + (j >> 2)));
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    }
    /* bits == 2: sixteen values a word, eight of them at a time */
    __m256i word = _mm256_set1_epi32((int)w[j >> 4]);
    int shift0 = (j & 8) ? 16 : 0;
    __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), _mm256_set1_epi32(shift0));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, shifts), _mm256_set1_epi32(0x3)));
}

AVX2 static inline void row_dot_avx2_n(const proj_t *p, size_t row, const int nb, const float *const *x,
                                       const float *const *xsum, float *y) {
    float scale[MAX_GROUPS], bias[MAX_GROUPS];
    row_scales(p, row, scale, bias);
    int bits = p->bits, gs = p->group_size, groups = p->in_dim / gs;
    const uint32_t *w = p->w + row * (size_t)(p->in_dim * bits / 32);
    __m256 total[BLOCK];
    float bias_part[BLOCK];
    for (int r = 0; r < nb; r++) {
        total[r] = _mm256_setzero_ps();
        bias_part[r] = 0.f;
    }
    for (int g = 0; g < groups; g++) {
        __m256 acc[BLOCK];
        for (int r = 0; r < nb; r++) acc[r] = _mm256_setzero_ps();
        int j0 = g * gs;
        for (int j = j0; j < j0 + gs; j += 8) {
            __m256 q = unpack8(w, j, bits);
            for (int r = 0; r < nb; r++) acc[r] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x[r] + j), acc[r]);
        }
        __m256 s = _mm256_set1_ps(scale[g]);
        for (int r = 0; r < nb; r++) {
            total[r] = _mm256_fmadd_ps(s, acc[r], total[r]);
            bias_part[r] += bias[g] * xsum[r][g];
        }
    }
    for (int r = 0; r < nb; r++) y[r] = hsum8(total[r]) + bias_part[r];
}

/* nb as a constant lets the compiler keep every accumulator in a register */
AVX2 static void row_dot_avx2(const proj_t *p, size_t row, int nb, const float *const *x,
                              const float *const *xsum, float *y) {
    switch (nb) {
    case 4: row_dot_avx2_n(p, row, 4, x, xsum, y); break;
    case 3: row_dot_avx2_n(p, row, 3, x, xsum, y); break;
    case 2: row_dot_avx2_n(p, row, 2, x, xsum, y); break;
    default: row_dot_avx2_n(p, row, 1, x, xsum, y); break;
    }
}
#endif

static int force_scalar = 0; /* tests: the portable path, on a machine that has AVX2 */

void moe_force_scalar(int on) { force_scalar = on; }

static row_dot_fn pick_row_dot(int gate_gs, int down_gs) {
#if EX_X86
    if (!force_scalar && gate_gs % 8 == 0 && down_gs % 8 == 0 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
        return row_dot_avx2;
#endif
    (void)gate_gs;
    (void)down_gs;
    return row_dot_scalar;
}

/* ---- the layer ------------------------------------------------------------------ */

typedef struct {
    proj_t gate, up, down;
    int hidden, inter, dtype; /* dtype: x's and out's; compute_dtype: where MLX rounds the steps */
    int compute_dtype;
    const int32_t *pair_token, *pair_slot;
    const int32_t *order;      /* pairs sorted by expert slot */
    const int32_t *unit_start; /* work units: runs of <= BLOCK pairs of one slot, in `order` */
    int n_units;
    const float *x, *xsum;     /* [T, hidden], [T, hidden / gate.group_size] */
    float *h, *hsum;           /* [P, inter], [P, inter / down.group_size] */
    void *out;                 /* [P, hidden] in dtype */
    row_dot_fn dot;
} layer_t;

typedef struct {
    const layer_t *L;
    int phase, thread, threads;
} job_t;

/* phase 0: h = swiglu(gate(x), up(x)) and its group sums; phase 1: out = down(h) */
static void run_unit(const layer_t *L, int phase, int unit) {
    int first = L->unit_start[unit], nb = L->unit_start[unit + 1] - first;
    const int32_t *pairs = L->order + first;
    int slot = L->pair_slot[pairs[0]];
    const float *x[BLOCK], *xs[BLOCK];
    float y[BLOCK], z[BLOCK];
    if (phase == 0) {
        int xg = L->hidden / L->gate.group_size, hg = L->inter / L->down.group_size, hgs = L->down.group_size;
        for (int r = 0; r < nb; r++) {
            int token = L->pair_token[pairs[r]];
            x[r] = L->x + (size_t)token * L->hidden;
            xs[r] = L->xsum + (size_t)token * xg;
        }
        size_t base = (size_t)slot * L->inter;
        for (int o = 0; o < L->inter; o++) {
            L->dot(&L->gate, base + o, nb, x, xs, y);
            L->dot(&L->up, base + o, nb, x, xs, z);
            for (int r = 0; r < nb; r++) {
                /* mlx-lm: silu(gate) * up, each step held in the type MLX computes in */
                int ct = L->compute_dtype;
                float gate = round_to(y[r], ct), up = round_to(z[r], ct);
                float sig = round_to(1.0f / (1.0f + expf(-gate)), ct);
                float act = round_to(gate * sig, ct);
                L->h[(size_t)pairs[r] * L->inter + o] = round_to(act * up, ct);
            }
        }
        for (int r = 0; r < nb; r++) {
            const float *hr = L->h + (size_t)pairs[r] * L->inter;
            float *sr = L->hsum + (size_t)pairs[r] * hg;
            for (int g = 0; g < hg; g++) {
                float s = 0.f;
                for (int j = 0; j < hgs; j++) s += hr[g * hgs + j];
                sr[g] = s;
            }
        }
    } else {
        int hg = L->inter / L->down.group_size;
        for (int r = 0; r < nb; r++) {
            x[r] = L->h + (size_t)pairs[r] * L->inter;
            xs[r] = L->hsum + (size_t)pairs[r] * hg;
        }
        size_t base = (size_t)slot * L->hidden;
        for (int o = 0; o < L->hidden; o++) {
            L->dot(&L->down, base + o, nb, x, xs, y);
            for (int r = 0; r < nb; r++)
                store_as(L->out, (size_t)pairs[r] * L->hidden + o, round_to(y[r], L->compute_dtype), L->dtype);
        }
    }
}

static void *run_job(void *arg) {
    const job_t *job = arg;
    for (int u = job->thread; u < job->L->n_units; u += job->threads) run_unit(job->L, job->phase, u);
    return NULL;
}

static void run_phase(const layer_t *L, int phase, int threads) {
    if (threads > L->n_units) threads = L->n_units;
    if (threads <= 1) {
        job_t job = {L, phase, 0, 1};
        run_job(&job);
        return;
    }
    pthread_t ids[64];
    job_t jobs[64];
    if (threads > 64) threads = 64;
    int started = 0;
    for (int t = 1; t < threads; t++) {
        jobs[t] = (job_t){L, phase, t, threads};
        if (pthread_create(&ids[t], NULL, run_job, &jobs[t]) != 0) break;
        started = t;
    }
    if (started < threads - 1) { /* could not start them all: the ones that run take every unit */
        for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
        jobs[0] = (job_t){L, phase, 0, 1};
        run_job(&jobs[0]);
        return;
    }
    jobs[0] = (job_t){L, phase, 0, threads};
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(ids[t], NULL);
}

static int proj_ok(const proj_t *p) {
    if (p->bits != 2 && p->bits != 4 && p->bits != 8) return 0;
    if (p->group_size <= 0 || p->in_dim % p->group_size || p->group_size % (32 / p->bits)) return 0;
    if (p->in_dim / p->group_size > MAX_GROUPS) return 0;
    return p->scale_dtype >= DT_F32 && p->scale_dtype <= DT_BF16;
}

/* Returns 0; -1 for a layout it does not take (the caller checked; a guard), -2 out of memory,
 * -3 a pair's token or slot out of range. x: [T, hidden] in `dtype`; pair_token, pair_slot: [P];
 * out: [P, hidden] in `dtype`; the steps are rounded to `compute_dtype` (MLX's promotion of the
 * hidden states' and the scales' types), the output once more to `dtype`. */
int moe_switch_glu(int n_tokens, int hidden, int inter, int dtype, int compute_dtype, const void *x, int n_pairs,
                   const int32_t *pair_token, const int32_t *pair_slot, int n_slots, const uint32_t *gate_w,
                   const void *gate_s, const void *gate_b, int gate_bits, int gate_gs, const uint32_t *up_w,
                   const void *up_s, const void *up_b, int up_bits, int up_gs, const uint32_t *down_w,
                   const void *down_s, const void *down_b, int down_bits, int down_gs, int scale_dtype,
                   void *out, int threads) {
    layer_t L = {
        .gate = {gate_w, gate_s, gate_b, inter, hidden, gate_bits, gate_gs, scale_dtype},
        .up = {up_w, up_s, up_b, inter, hidden, up_bits, up_gs, scale_dtype},
        .down = {down_w, down_s, down_b, hidden, inter, down_bits, down_gs, scale_dtype},
        .hidden = hidden,
        .inter = inter,
        .dtype = dtype,
        .compute_dtype = compute_dtype,
        .pair_token = pair_token,
        .pair_slot = pair_slot,
    };
    if (!proj_ok(&L.gate) || !proj_ok(&L.up) || !proj_ok(&L.down) || gate_gs != up_gs) return -1;
    if (dtype < DT_F32 || dtype > DT_BF16 || compute_dtype < DT_F32 || compute_dtype > DT_BF16) return -1;
    if (n_pairs < 0 || n_tokens < 0 || n_slots < 0) return -1;
    for (int i = 0; i < n_pairs; i++)
        if (pair_token[i] < 0 || pair_token[i] >= n_tokens || pair_slot[i] < 0 || pair_slot[i] >= n_slots) return -3;
    if (n_pairs == 0) return 0;
    L.dot = pick_row_dot(gate_gs, down_gs);

    int xg = hidden / gate_gs, hg = inter / down_gs;
    float *xf = malloc(sizeof(float) * ((size_t)n_tokens * (hidden + xg) + (size_t)n_pairs * (inter + hg)));
    int32_t *ints = malloc(sizeof(int32_t) * ((size_t)n_pairs * 2 + (size_t)n_slots + 3));
    if (!xf || !ints) {
        free(xf);
        free(ints);
        return -2;
    }
    float *xsum = xf + (size_t)n_tokens * hidden;
    L.h = xsum + (size_t)n_tokens * xg;
    L.hsum = L.h + (size_t)n_pairs * inter;
    rows_as_float(x, dtype, n_tokens, hidden, gate_gs, xf, xsum);
    L.x = xf;
    L.xsum = xsum;
    L.out = out;

    /* counting sort of the pairs by slot, then runs of <= BLOCK pairs per slot */
    int32_t *order = ints, *unit_start = ints + n_pairs, *count = ints + 2 * n_pairs + 1;
    memset(count, 0, sizeof(int32_t) * ((size_t)n_slots + 1));
    for (int i = 0; i < n_pairs; i++) count[pair_slot[i] + 1]++;
    for (int s = 0; s < n_slots; s++) count[s + 1] += count[s];
    for (int i = 0; i < n_pairs; i++) order[count[pair_slot[i]]++] = i;
    int units = 0;
    for (int i = 0; i < n_pairs;) {
        int j = i + 1;
        while (j < n_pairs && j - i < BLOCK && pair_slot[order[j]] == pair_slot[order[i]]) j++;
        unit_start[units++] = i;
        i = j;
    }
    unit_start[units] = n_pairs; /* units <= n_pairs, and unit_start has n_pairs + 1 entries */
    L.order = order;
    L.unit_start = unit_start;
    L.n_units = units;

    run_phase(&L, 0, threads);
    run_phase(&L, 1, threads);
    free(xf);
    free(ints);
    return 0;
}

/* ---- one dense projection ------------------------------------------------------------ */

/* Core's attention projections (and lm_head for a decode step) on a Linux CPU go through the
 * same row dots: out[t, o] = dot(row o, x[t]) for T tokens, rounded once to `dtype` (x's type).
 * Threads take contiguous row ranges; within one, a tile of rows meets every block of up to
 * BLOCK tokens while both are in L1. */
#define ROW_TILE 32

typedef struct {
    const proj_t *p;
    const float *x, *xsum; /* [T, in], [T, in / group] */
    int n_tokens, dtype, row0, row1;
    void *out; /* [T, out] */
    row_dot_fn dot;
} linear_job_t;

static void *run_linear(void *arg) {
    const linear_job_t *J = arg;
    const proj_t *p = J->p;
    int in = p->in_dim, xg = in / p->group_size;
    const float *x[BLOCK], *xs[BLOCK];
    float y[BLOCK];
    for (int tile = J->row0; tile < J->row1; tile += ROW_TILE) {
        int tile_end = tile + ROW_TILE < J->row1 ? tile + ROW_TILE : J->row1;
        for (int t0 = 0; t0 < J->n_tokens; t0 += BLOCK) {
            int nb = J->n_tokens - t0 < BLOCK ? J->n_tokens - t0 : BLOCK;
            for (int r = 0; r < nb; r++) {
                x[r] = J->x + (size_t)(t0 + r) * in;
                xs[r] = J->xsum + (size_t)(t0 + r) * xg;
            }
            for (int o = tile; o < tile_end; o++) {
                J->dot(p, (size_t)o, nb, x, xs, y);
                for (int r = 0; r < nb; r++) store_as(J->out, (size_t)(t0 + r) * p->out_dim + o, y[r], J->dtype);
            }
        }
    }
    return NULL;
}

/* Returns 0; -1 for a layout it does not take, -2 out of memory. x: [T, in] in `dtype`; weight
 * uint32 [out, in * bits / 32], scales and biases [out, in / group] in `scale_dtype`; out:
 * [T, out] in `dtype`. */
int moe_quantized_linear(int n_tokens, int in_dim, int out_dim, int dtype, const void *x, const uint32_t *w,
                         const void *scales, const void *biases, int bits, int group_size, int scale_dtype,
                         void *out, int threads) {
    proj_t p = {w, scales, biases, out_dim, in_dim, bits, group_size, scale_dtype};
    if (!proj_ok(&p) || dtype < DT_F32 || dtype > DT_BF16 || n_tokens < 0 || out_dim < 0) return -1;
    if (n_tokens == 0 || out_dim == 0) return 0;
    int xg = in_dim / group_size;
    float *xf = malloc(sizeof(float) * (size_t)n_tokens * (in_dim + xg));
    if (!xf) return -2;
    float *xsum = xf + (size_t)n_tokens * in_dim;
    rows_as_float(x, dtype, n_tokens, in_dim, group_size, xf, xsum);
    row_dot_fn dot = pick_row_dot(group_size, group_size);
    int tiles = (out_dim + ROW_TILE - 1) / ROW_TILE;
    if (threads > tiles) threads = tiles;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
    pthread_t ids[64];
    linear_job_t jobs[64];
    int per = (tiles + threads - 1) / threads * ROW_TILE, started = 0;
    for (int t = 0; t < threads; t++) {
        int row0 = t * per < out_dim ? t * per : out_dim, row1 = (t + 1) * per < out_dim ? (t + 1) * per : out_dim;
        jobs[t] = (linear_job_t){&p, xf, xsum, n_tokens, dtype, row0, row1, out, dot};
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_linear, &jobs[t]) != 0) break;
        started = t;
    }
    run_linear(&jobs[0]);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
    for (int t = started + 1; t < threads; t++) run_linear(&jobs[t]); /* the ones no thread took */
    free(xf);
    return 0;
}

int moe_has_avx2(void) {
#if EX_X86
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static struct PyModuleDef ex_module = {PyModuleDef_HEAD_INIT, "_experts_cpu",
                                       "Routed-expert CPU kernels (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__experts_cpu(void) { return PyModule_Create(&ex_module); }
