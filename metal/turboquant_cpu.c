/* TurboQuant's decode step for CPUs: what metal/turboquant.metal's fused decode does on a
 * GPU, in one call, for machines without a GPU backend (loaded by metal/cpu_kernels.py
 * through ctypes; built by setup.py as metal._turboquant_cpu).
 *
 * Why: MLX has no custom-kernel API on the CPU, so the pure-MLX twin must decode the
 * compressed run into float32 arrays and read them back through matmuls: five passes over
 * 4-byte floats per coordinate. Here each token's packed bytes are decoded once, into a
 * buffer that stays in L1, and consumed at once: the cache is read at its packed size.
 *
 * Bit layout (services/core/kv/packing.py): a vector's indices are one byte row of planes
 * whose widths divide 8. Decoding uses the twin's own lookup tables (packing.lookup_table):
 * a table row holds the decoded floats of one group of coordinates for one bit pattern
 *   1 bit: a byte (8 coords)   2 bits: a byte (4)   4 bits: a byte (2)
 *   3 bits: the 2-bit plane's byte plus the matching nibble of the 1-bit plane (4 coords)
 * so the numbers are the codebook's own floats, as in the twin.
 *
 * Strides are in elements along the flattened batch x kv-head axis ("g"); within a head,
 * tokens are rows of `row_bytes` (codes, signs) or consecutive halfs (norms), which is how
 * the cache's token buffers lie in memory (they may have spare capacity past T).
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half_float.h"

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define TQ_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TQ_CLONES
#endif

#define TQ_MAX_P 1024

static inline int group_size(int bits) {
    switch (bits) {
    case 1: return 8;
    case 4: return 2;
    default: return 4;
    }
}

/* out[0..P) = table values of one packed row (see the layout above) */
static inline void decode_row(const uint8_t* row, int P, int bits, const float* table, float* out) {
    int gs = group_size(bits);
    int groups = P / gs;
    if (bits == 3) {
        const uint8_t* high = row + P / 4;
        for (int i = 0; i < groups; ++i) {
            int pattern = row[i] | (((high[i >> 1] >> ((i & 1) * 4)) & 15) << 8);
            memcpy(out + 4 * i, table + 4 * pattern, 4 * sizeof(float));
        }
    } else {
        for (int i = 0; i < groups; ++i) memcpy(out + gs * i, table + gs * row[i], gs * sizeof(float));
    }
}

/* 8 float lanes: GCC and clang lower this to AVX (or two SSE / NEON registers) */
typedef float lanes8 __attribute__((vector_size(32)));

static inline lanes8 load8(const float* p) {
    lanes8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(lanes8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* a . b over n floats, n a multiple of 8 (padded head dims are powers of two >= 8) */
static inline float dot(const float* a, const float* b, int n) {
    lanes8 acc0 = {0}, acc1 = {0};
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        acc0 += load8(a + j) * load8(b + j);
        acc1 += load8(a + j + 8) * load8(b + j + 8);
    }
    if (j < n) acc0 += load8(a + j) * load8(b + j);
    return sum8(acc0 + acc1);
}

/* a . b and o += w a over any n (head dims of the exact runs need not be multiples of 8) */
static inline float dot_any(const float* a, const float* b, int n) {
    int head = n & ~7;
    float s = head ? dot(a, b, head) : 0.0f;
    for (int j = head; j < n; ++j) s += a[j] * b[j];
    return s;
}

static inline void axpy_any(float* o, float w, const float* a, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        lanes8 acc = load8(o + j) + w * load8(a + j);
        memcpy(o + j, &acc, sizeof acc);
    }
    for (; j < n; ++j) o[j] += w * a[j];
}

/* One decode step of attention for every head, in one call: softmax over the scores of
 * the sinks (exact), the compressed run (from its codes) and the recent window (exact),
 * then the weighted sum of values. The exact runs' sum comes out in the original domain
 * (out_exact [G, L, D]); the compressed run's in the rotated one (out_rotated [G, L, P]),
 * for the caller to rotate back once. q: scaled queries [G, L, D]; qr = q rotated and
 * padded [G, L, P]; sq = qr S^T (NULL without QJL); query_pos [L]: the position of each
 * row, a key at position k is visible to it when k <= query_pos. Sinks sit at positions
 * [0, S), the compressed run at [S, S + C), the window at [S + C, S + C + R). Exact keys
 * and values are float32 rows of D with head strides; scratch holds L * (S + C + R) floats.
 * Returns 0, or -1 unless P is a multiple of 8 up to TQ_MAX_P. */
TQ_CLONES int tq_cpu_attention(int G, int L, int D, int P, const float* q, const float* qr, const float* sq,
                               const int* query_pos, int S, const float* sink_k, const float* sink_v,
                               long sink_stride, int C, int key_bits, const uint8_t* key_codes,
                               long key_codes_stride, int key_code_bytes, const uint16_t* key_norm,
                               long key_norm_stride, const uint16_t* rnorm, long rnorm_stride,
                               const uint8_t* signs, long signs_stride, const float* key_table,
                               const float* sign_table, int value_bits, const uint8_t* value_codes,
                               long value_codes_stride, int value_code_bytes, const uint16_t* value_norm,
                               long value_norm_stride, const float* value_table, int R, const float* recent_k,
                               const float* recent_v, long recent_stride, float* scratch, float* out_exact,
                               float* out_rotated) {
    if (P > TQ_MAX_P || P % 8) return -1;
    const float masked = -3.402823466e38f;
    const int total = S + C + R;
    float c[TQ_MAX_P], s[TQ_MAX_P];
    memset(out_exact, 0, sizeof(float) * (size_t)G * L * D);
    memset(out_rotated, 0, sizeof(float) * (size_t)G * L * P);
    for (int g = 0; g < G; ++g) {
        const float* qg = q + (long)g * L * D;
        const float* qrg = qr + (long)g * L * P;
        const float* sqg = signs ? sq + (long)g * L * P : NULL;
        /* scores, row-major [L, total], masked where not visible */
        for (int t = 0; t < S; ++t) {
            const float* k = sink_k + g * sink_stride + (long)t * D;
            for (int l = 0; l < L; ++l)
                scratch[(long)l * total + t] = t <= query_pos[l] ? dot_any(qg + l * D, k, D) : masked;
        }
        for (int t = 0; t < C; ++t) {
            decode_row(key_codes + g * key_codes_stride + (long)t * key_code_bytes, P, key_bits, key_table, c);
            float n = half_to_float(key_norm[g * key_norm_stride + t]);
            float r = 0.0f;
            if (signs) {
                decode_row(signs + g * signs_stride + (long)t * (P / 8), P, 1, sign_table, s);
                r = half_to_float(rnorm[g * rnorm_stride + t]);
            }
            for (int l = 0; l < L; ++l) {
                float v = masked;
                if (S + t <= query_pos[l]) {
                    float e = dot(qrg + l * P, c, P);
                    if (signs) e += r * dot(sqg + l * P, s, P);
                    v = n * e;
                }
                scratch[(long)l * total + S + t] = v;
            }
        }
        for (int t = 0; t < R; ++t) {
            const float* k = recent_k + g * recent_stride + (long)t * D;
            for (int l = 0; l < L; ++l)
                scratch[(long)l * total + S + C + t] =
                    S + C + t <= query_pos[l] ? dot_any(qg + l * D, k, D) : masked;
        }
        /* softmax per row (max-subtracted, float32, like mx.softmax(precise=True)) */
        for (int l = 0; l < L; ++l) {
            float* row = scratch + (long)l * total;
            float top = masked;
            for (int t = 0; t < total; ++t) top = row[t] > top ? row[t] : top;
            float sum = 0.0f;
            for (int t = 0; t < total; ++t) {
                float e = row[t] == masked ? 0.0f : expf(row[t] - top);
                row[t] = e;
                sum += e;
            }
            float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int t = 0; t < total; ++t) row[t] *= inv;
        }
        /* weighted values */
        float* oe = out_exact + (long)g * L * D;
        float* orot = out_rotated + (long)g * L * P;
        for (int t = 0; t < S; ++t) {
            const float* v = sink_v + g * sink_stride + (long)t * D;
            for (int l = 0; l < L; ++l) {
                float w = scratch[(long)l * total + t];
                if (w != 0.0f) axpy_any(oe + l * D, w, v, D);
            }
        }
        for (int t = 0; t < C; ++t) {
            decode_row(value_codes + g * value_codes_stride + (long)t * value_code_bytes, P, value_bits,
                       value_table, c);
            float n = half_to_float(value_norm[g * value_norm_stride + t]);
            for (int l = 0; l < L; ++l) {
                float w = scratch[(long)l * total + S + t] * n;
                if (w != 0.0f) axpy_any(orot + l * P, w, c, P);
            }
        }
        for (int t = 0; t < R; ++t) {
            const float* v = recent_v + g * recent_stride + (long)t * D;
            for (int l = 0; l < L; ++l) {
                float w = scratch[(long)l * total + S + C + t];
                if (w != 0.0f) axpy_any(oe + l * D, w, v, D);
            }
        }
    }
    return 0;
}

/* An importable module, so that setuptools builds and installs it like any extension; the
 * functions above are called through ctypes (plain C ABI, no Python objects involved). */
static struct PyModuleDef tq_module = {PyModuleDef_HEAD_INIT, "_turboquant_cpu",
                                       "TurboQuant CPU kernels (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__turboquant_cpu(void) { return PyModule_Create(&tq_module); }
