// TurboQuant kernels for mx.fast.cuda_kernel (loaded by metal/cuda_kernels.py): the CUDA
// twin of metal/turboquant.metal, section for section, same inputs, outputs and grids.
//
// Bit layout (services/core/kv/packing.py): the indices of one vector of P coordinates
// are one byte row made of planes whose widths divide 8, so no index straddles a byte:
//   1 bit: [1-bit plane, P/8 bytes]   2 bits: [2-bit plane, P/4 bytes]
//   3 bits: [2-bit plane (low bits), P/4 bytes][1-bit plane (high bit), P/8 bytes]
//   4 bits: [nibbles, P/2 bytes]
// Coordinate j of a plane of width w sits in byte j / (8/w), bits (j % (8/w)) * w.
// QJL signs are one more 1-bit plane: bit j set <=> (S r)_j >= 0.
//
// MLX writes the kernel signature (inputs, then `<name>_shape` / `<name>_strides` where the
// body names them, then outputs) and turns template arguments into constexpr ints or type
// aliases. grid is counted in threads, as in Metal; blocks = grid / threadgroup.
//
// Sections are separated by lines "//// <name>"; "header" is shared by all kernels.

//// header
// -inf for an empty softmax row (the `inf` macro of some MLX versions' header is not in all)
#define TQ_NEG_INF (-cuda::std::numeric_limits<float>::infinity())

__device__ __forceinline__ unsigned tq_index(const uint8_t* row, unsigned j, int bits, unsigned P) {
    if (bits == 4) return (row[j >> 1] >> ((j & 1u) * 4u)) & 15u;
    if (bits == 2) return (row[j >> 2] >> ((j & 3u) * 2u)) & 3u;
    if (bits == 1) return (row[j >> 3] >> (j & 7u)) & 1u;
    unsigned low = (row[j >> 2] >> ((j & 3u) * 2u)) & 3u;
    unsigned high = (row[P / 4 + (j >> 3)] >> (j & 7u)) & 1u;
    return low | (high << 2);
}

__device__ __forceinline__ float tq_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float tq_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

//// pack
// One block of P threads per vector. Inputs: x [N, D] float, rotation [P, P] (row-major,
// y = x_pad @ rotation), boundaries [2^BITS - 1], centroids [2^BITS], qjl_t [P, P] (S^T).
// Outputs: norm [N] half, codes [N, CODE_BYTES] uint8, residual_norm [N] half,
// signs [N, P/8] uint8. Template: P, D, BITS, QJL, CODE_BYTES.
unsigned n = blockIdx.x;
unsigned j = threadIdx.x;
__shared__ float unit[P];
__shared__ float residual[P];
__shared__ unsigned idx[P];
__shared__ float partial[P];

float xj = j < (unsigned)D ? x[n * D + j] : 0.0f;
partial[j] = xj * xj;
__syncthreads();
for (unsigned stride = P / 2; stride > 0; stride >>= 1) {
    if (j < stride) partial[j] += partial[j + stride];
    __syncthreads();
}
float nrm = sqrtf(partial[0]);
float inv = 1.0f / fmaxf(nrm, 1e-12f);
__syncthreads();
unit[j] = xj * inv;
__syncthreads();
float y = 0.0f;
for (unsigned i = 0; i < (unsigned)D; ++i) y += unit[i] * rotation[i * P + j];
unsigned k = 0;
for (unsigned b = 0; b < (1u << BITS) - 1; ++b) k += y > boundaries[b] ? 1u : 0u;
idx[j] = k;
residual[j] = y - centroids[k];
__syncthreads();
uint8_t* row = codes + n * CODE_BYTES;
if (BITS == 4) {
    if (j < P / 2) row[j] = uint8_t(idx[2 * j] | (idx[2 * j + 1] << 4));
} else if (BITS == 1) {
    if (j < P / 8) { unsigned v = 0; for (unsigned t = 0; t < 8; ++t) v |= (idx[8 * j + t] & 1u) << t; row[j] = uint8_t(v); }
} else {
    if (j < P / 4) { unsigned v = 0; for (unsigned t = 0; t < 4; ++t) v |= (idx[4 * j + t] & 3u) << (2 * t); row[j] = uint8_t(v); }
    if (BITS == 3 && j < P / 8) {
        unsigned v = 0; for (unsigned t = 0; t < 8; ++t) v |= ((idx[8 * j + t] >> 2) & 1u) << t;
        row[P / 4 + j] = uint8_t(v);
    }
}
if (j == 0) norm[n] = __float2half(nrm);
__syncthreads();  // idx is reused below
if (QJL) {
    partial[j] = residual[j] * residual[j];
    float s = 0.0f;
    for (unsigned i = 0; i < (unsigned)P; ++i) s += residual[i] * qjl_t[i * P + j];
    idx[j] = s >= 0.0f ? 1u : 0u;
    __syncthreads();
    for (unsigned stride = P / 2; stride > 0; stride >>= 1) {
        if (j < stride) partial[j] += partial[j + stride];
        __syncthreads();
    }
    if (j < P / 8) { unsigned v = 0; for (unsigned t = 0; t < 8; ++t) v |= idx[8 * j + t] << t; signs[n * (P / 8) + j] = uint8_t(v); }
    if (j == 0) residual_norm[n] = __float2half(sqrtf(partial[0]));
}

//// scores
// scores[g, l, t] = norm[g,t] * (sum_j q[g,l,j] c[idx_j] + qjl_scale * rnorm[g,t] * sum_j sq[g,l,j] sgn_j)
// q: rotated queries [G, L, P]; sq: q @ S^T [G, L, P] (unused without QJL); codes
// [G, T, CODE_BYTES]; norm, residual_norm [G, T] half; signs [G, T, P/8].
// Grid (T, ceil(L / ROWS), G): one thread per token and tile of ROWS query rows, so a
// token's code bytes are decoded once per tile, not once per query row.
// Template: P, L, ROWS, BITS, QJL, CODE_BYTES.
unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
unsigned l0 = blockIdx.y * ROWS;
unsigned g = blockIdx.z;
unsigned T = norm_shape[1];
if (t >= T) return;
const uint8_t* row = codes + ((size_t)g * T + t) * CODE_BYTES;
const float* qrows = queries + ((size_t)g * L + l0) * P;
float acc[ROWS];
float qjl[ROWS];
for (int r = 0; r < ROWS; ++r) acc[r] = qjl[r] = 0.0f;
for (unsigned j = 0; j < (unsigned)P; ++j) {
    float c = centroids[tq_index(row, j, BITS, P)];
    for (int r = 0; r < ROWS; ++r) if (l0 + r < (unsigned)L) acc[r] += qrows[r * P + j] * c;
}
float nrm = __half2float(norm[(size_t)g * T + t]);
float rn = 0.0f;
if (QJL) {
    const uint8_t* srow = signs + ((size_t)g * T + t) * (P / 8);
    const float* sq = projected + ((size_t)g * L + l0) * P;
    for (unsigned j = 0; j < (unsigned)P; ++j) {
        bool up = (srow[j >> 3] >> (j & 7u)) & 1u;
        for (int r = 0; r < ROWS; ++r) if (l0 + r < (unsigned)L) qjl[r] += up ? sq[r * P + j] : -sq[r * P + j];
    }
    rn = qjl_scale[0] * __half2float(residual_norm[(size_t)g * T + t]);
}
for (int r = 0; r < ROWS; ++r) {
    if (l0 + r < (unsigned)L) scores[((size_t)g * L + l0 + r) * T + t] = (acc[r] + rn * qjl[r]) * nrm;
}

//// values
// partial[g, c, l, j] = sum over the tokens t of chunk c of w[g, l, t] * norm[g, t] * c[idx(t, j)],
// still rotated (the caller sums the chunks). weights [G, L, T] float; codes [G, T, CODE_BYTES];
// norm [G, T] half. Grid (P * chunks, ceil(L / ROWS), G), threadgroup P: a block walks CHUNK
// tokens, so T is split over many blocks instead of one thread walking all of it.
// Template: P, L, ROWS, CHUNK, BITS, CODE_BYTES.
unsigned j = threadIdx.x;
unsigned chunk = blockIdx.x;
unsigned l0 = blockIdx.y * ROWS;
unsigned g = blockIdx.z;
unsigned T = norm_shape[1];
unsigned chunks = gridDim.x;
unsigned begin = chunk * CHUNK;
unsigned end = min(T, begin + CHUNK);
float acc[ROWS];
for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
const float* w = weights + ((size_t)g * L + l0) * T;
for (unsigned t = begin; t < end; ++t) {
    const uint8_t* row = codes + ((size_t)g * T + t) * CODE_BYTES;
    float v = __half2float(norm[(size_t)g * T + t]) * centroids[tq_index(row, j, BITS, P)];
    for (int r = 0; r < ROWS; ++r) if (l0 + r < (unsigned)L) acc[r] += w[(size_t)r * T + t] * v;
}
for (int r = 0; r < ROWS; ++r) {
    if (l0 + r < (unsigned)L) out[(((size_t)g * chunks + chunk) * L + l0 + r) * P + j] = acc[r];
}

//// decode_partial
// Fused decode attention, pass 1 of 2 (split-K / flash decoding): every block scores one
// chunk of TB tokens against all R = rep * L query rows of one KV head and keeps a partial
// softmax (row max, sum of exp, exp-weighted value sum) of that chunk alone.
// Blocks [0, NBE) walk the exact tokens (sinks, then the recent window) in the model's
// domain; blocks [NBE, NBE + NBC) walk the compressed run from its codes in the rotated
// domain (key codec's rotation for scores, value codec's for the value sum). Nothing is
// decoded to memory.
// Inputs: queries [B, Hq, L, D] (QT); params float [2] = (scale, qjl_scale); lengths int [4]
// = (sinks, compressed, recent, position of query row 0); sink_k, sink_v [B, H, >=sinks, D]
// and recent_k, recent_v [B, H, capacity, D] (KT); k_norm [B, H, cap], k_codes
// [B, H, cap, key bytes], k_rnorm [B, H, cap], k_signs [B, H, cap, P/8]; v_norm, v_codes
// [B, H, cap, value bytes]: whole buffers (spare capacity is never read), any strides; k_rotation
// [P, P], qjl_t [P, P] (strided too: codec.qjl_matrix_t is a transposed view); k_centroids, v_centroids.
// Outputs: part_m, part_l [G, NB, R], part_acc [G, NB, R, P] float (exact blocks fill the
// first D columns). Grid (NB * TB, G), threadgroup TB.
// Template: P, D, R, L, TB, KBITS, VBITS, QJL, QT, KT.
constexpr int NS = TB / P;  // value pass: NS slices of P threads, each summing every NS-th token
__shared__ float q_s[R * P];
__shared__ float qp_s[QJL ? R * P : 1];
__shared__ float p_s[R * TB];
__shared__ float red_s[R * TB];
const float NEG = TQ_NEG_INF;

unsigned tid = threadIdx.x;
unsigned block = blockIdx.x;
unsigned g = blockIdx.y;
unsigned H = k_norm_shape[1];
unsigned b = g / H, h = g % H;
unsigned rep = R / L;
int sinks = lengths[0], compressed = lengths[1], recent = lengths[2], start = lengths[3];
int offset = sinks + compressed + recent;
int nbe = (sinks + recent + TB - 1) / TB;
bool exact = (int)block < nbe;
int first = exact ? (int)block * TB : ((int)block - nbe) * TB;
int count = exact ? sinks + recent : compressed;
float scale = params[0];

// query rows r = rr * L + l of head h * rep + rr, position start + l
for (unsigned i = tid; i < (unsigned)(R * D); i += TB) {
    unsigned r = i / D, d = i % D;
    size_t at = b * queries_strides[0] + (h * rep + r / L) * queries_strides[1] + (r % L) * queries_strides[2]
        + d * queries_strides[3];
    red_s[i] = static_cast<float>(queries[at]) * scale;  // staging (red_s is free until the value pass)
}
__syncthreads();
if (exact) {
    for (unsigned i = tid; i < (unsigned)(R * D); i += TB) q_s[(i / D) * P + i % D] = red_s[i];
} else {
    for (unsigned i = tid; i < (unsigned)(R * P); i += TB) {
        unsigned r = i / P, j = i % P;
        float y = 0.0f;
        for (unsigned d = 0; d < (unsigned)D; ++d)
            y += red_s[r * D + d] * k_rotation[d * k_rotation_strides[0] + j * k_rotation_strides[1]];
        q_s[i] = y;
    }
    if (QJL) {
        __syncthreads();
        for (unsigned i = tid; i < (unsigned)(R * P); i += TB) {
            unsigned r = i / P, j = i % P;
            float y = 0.0f;
            for (unsigned k = 0; k < (unsigned)P; ++k) y += q_s[r * P + k] * qjl_t[k * qjl_t_strides[0] + j * qjl_t_strides[1]];
            qp_s[i] = y;
        }
    }
}
__syncthreads();

// scores: one thread per token of the chunk
{
    int t = first + (int)tid;
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    int position = 0;
    bool valid = t < count;
    if (valid && exact) {
        bool is_sink = t < sinks;
        int slot = is_sink ? t : t - sinks;
        position = is_sink ? t : sinks + compressed + slot;
        const KT* key = is_sink
            ? sink_k + b * sink_k_strides[0] + h * sink_k_strides[1] + slot * sink_k_strides[2]
            : recent_k + b * recent_k_strides[0] + h * recent_k_strides[1] + slot * recent_k_strides[2];
        long long ks = is_sink ? sink_k_strides[3] : recent_k_strides[3];
        for (int d = 0; d < D; ++d) {
            float k = static_cast<float>(key[d * ks]);
            for (int r = 0; r < R; ++r) acc[r] += q_s[r * P + d] * k;
        }
    } else if (valid) {
        position = sinks + t;
        const uint8_t* row = k_codes + b * k_codes_strides[0] + h * k_codes_strides[1] + t * k_codes_strides[2];
        for (unsigned j = 0; j < (unsigned)P; ++j) {
            float c = k_centroids[tq_index(row, j, KBITS, P)];
            for (int r = 0; r < R; ++r) acc[r] += q_s[r * P + j] * c;
        }
        if (QJL) {
            const uint8_t* srow = k_signs + b * k_signs_strides[0] + h * k_signs_strides[1] + t * k_signs_strides[2];
            float qjl[R];
            for (int r = 0; r < R; ++r) qjl[r] = 0.0f;
            for (unsigned j = 0; j < (unsigned)P; ++j) {
                bool up = (srow[j >> 3] >> (j & 7u)) & 1u;
                for (int r = 0; r < R; ++r) qjl[r] += up ? qp_s[r * P + j] : -qp_s[r * P + j];
            }
            float rn = params[1] * static_cast<float>(
                k_rnorm[b * k_rnorm_strides[0] + h * k_rnorm_strides[1] + t * k_rnorm_strides[2]]);
            for (int r = 0; r < R; ++r) acc[r] += rn * qjl[r];
        }
        float nrm = static_cast<float>(k_norm[b * k_norm_strides[0] + h * k_norm_strides[1] + t * k_norm_strides[2]]);
        for (int r = 0; r < R; ++r) acc[r] *= nrm;
    }
    for (int r = 0; r < R; ++r) {
        int query = start + r % L;
        bool visible = valid && (position <= query || query >= offset);
        p_s[r * TB + tid] = visible ? acc[r] : NEG;
    }
}
__syncthreads();

// partial softmax of each row over this chunk: one warp per row
{
    unsigned warp = tid / 32, lane = tid % 32;
    float* out_m = part_m + ((size_t)g * gridDim.x + block) * R;
    float* out_l = part_l + ((size_t)g * gridDim.x + block) * R;
    for (unsigned r = warp; r < (unsigned)R; r += TB / 32) {
        float m = NEG;
        for (unsigned i = lane; i < (unsigned)TB; i += 32) m = fmaxf(m, p_s[r * TB + i]);
        m = tq_warp_max(m);
        float s = 0.0f;
        for (unsigned i = lane; i < (unsigned)TB; i += 32) {
            float v = p_s[r * TB + i];
            float e = v == NEG ? 0.0f : __expf(v - m);
            p_s[r * TB + i] = e;
            s += e;
        }
        s = tq_warp_sum(s);
        if (lane == 0) {
            out_m[r] = m;
            out_l[r] = s;
        }
    }
}
__syncthreads();

// exp-weighted value sum: slice s of NS sums tokens s, s + NS, ... for coordinate j
{
    unsigned j = tid % P, slice = tid / P;
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    int stop = min(TB, count - first);
    if (exact) {
        if (j < (unsigned)D) {
            for (int i = slice; i < stop; i += NS) {
                int t = first + i;
                bool is_sink = t < sinks;
                int slot = is_sink ? t : t - sinks;
                float v = is_sink
                    ? static_cast<float>(sink_v[b * sink_v_strides[0] + h * sink_v_strides[1]
                        + slot * sink_v_strides[2] + j * sink_v_strides[3]])
                    : static_cast<float>(recent_v[b * recent_v_strides[0] + h * recent_v_strides[1]
                        + slot * recent_v_strides[2] + j * recent_v_strides[3]]);
                for (int r = 0; r < R; ++r) acc[r] += p_s[r * TB + i] * v;
            }
        }
    } else {
        for (int i = slice; i < stop; i += NS) {
            int t = first + i;
            const uint8_t* row = v_codes + b * v_codes_strides[0] + h * v_codes_strides[1] + t * v_codes_strides[2];
            float v = static_cast<float>(v_norm[b * v_norm_strides[0] + h * v_norm_strides[1] + t * v_norm_strides[2]])
                * v_centroids[tq_index(row, j, VBITS, P)];
            for (int r = 0; r < R; ++r) acc[r] += p_s[r * TB + i] * v;
        }
    }
    for (int r = 0; r < R; ++r) red_s[(slice * R + r) * P + j] = acc[r];
}
__syncthreads();
for (unsigned i = tid; i < (unsigned)(R * P); i += TB) {
    float s = 0.0f;
    for (int slice = 0; slice < NS; ++slice) s += red_s[slice * R * P + i];
    part_acc[((size_t)g * gridDim.x + block) * R * P + i] = s;
}

//// decode_combine
// Fused decode attention, pass 2 of 2: merges the partial softmaxes of all blocks of one
// (KV head, query row) and rotates the compressed run's value sum back once:
//   out = (sum_exact e^(m_b - M) acc_b + F_v^T sum_compressed e^(m_b - M) acc_b) / sum_b e^(m_b - M) l_b
// Inputs: part_m, part_l [G, NB, R], part_acc [G, NB, R, P], lengths int [4] (as in
// decode_partial), v_rotation [P, P] (the value codec's F_v). Output: out [G, R, D] (OT).
// Grid (P, R, G), threadgroup P. Template: P, D, R, TB, OT.
__shared__ float rotated_s[P];
unsigned j = threadIdx.x;
unsigned r = blockIdx.y;
unsigned g = blockIdx.z;
unsigned NB = part_m_shape[1];
int nbe = (lengths[0] + lengths[2] + TB - 1) / TB;
const float* m = part_m + (size_t)g * NB * R;
const float* l = part_l + (size_t)g * NB * R;
float top = TQ_NEG_INF;
for (unsigned k = 0; k < NB; ++k) top = fmaxf(top, m[k * R + r]);
float total = 0.0f, exact_sum = 0.0f, rotated_sum = 0.0f;
for (unsigned k = 0; k < NB; ++k) {
    float mk = m[k * R + r];
    float e = mk == TQ_NEG_INF ? 0.0f : __expf(mk - top);
    total += e * l[k * R + r];
    float a = part_acc[(((size_t)g * NB + k) * R + r) * P + j];
    if ((int)k < nbe) {
        if (j < (unsigned)D) exact_sum += e * a;
    } else {
        rotated_sum += e * a;
    }
}
rotated_s[j] = rotated_sum;
__syncthreads();
if (j < (unsigned)D) {
    float y = exact_sum;
    for (unsigned k = 0; k < (unsigned)P; ++k) y += rotated_s[k] * v_rotation[j * P + k];
    out[((size_t)g * R + r) * D + j] = static_cast<OT>(y / total);
}

//// decode_run
// A compressed run decoded into the rotated domain for one prefill call (the twin:
// codec.estimated_keys / decode_rotated), one thread per coordinate:
//   keys[g, t, j]   = |k| c_k[idx_j]                      (the MSE part of the key)
//   k_sign[g, t, j] = |k| qjl_scale |r| (+1 | -1)          (QJL: the caller adds k_sign @ S)
//   values[g, t, j] = |v| c_v[idx_j]
// Inputs: k_norm, k_rnorm, v_norm [G, T] half; k_codes [G, T, KCODE_BYTES], k_signs
// [G, T, P/8], v_codes [G, T, VCODE_BYTES] uint8; k_centroids, v_centroids float;
// qjl_scale [1] float. Outputs [G, T, P] of OT. Grid (T * P, G, 1), threadgroup 256.
// Template: P, KBITS, VBITS, QJL, KCODE_BYTES, VCODE_BYTES, OT.
size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
unsigned g = blockIdx.y;
size_t T = k_norm_shape[1];
if (tid >= T * P) return;
size_t t = tid / P;
unsigned j = (unsigned)(tid % P);
size_t row = (size_t)g * T + t;
size_t at = row * P + j;
float kn = __half2float(k_norm[row]);
keys[at] = static_cast<OT>(kn * k_centroids[tq_index(k_codes + row * KCODE_BYTES, j, KBITS, P)]);
if (QJL) {
    bool up = (k_signs[row * (P / 8) + (j >> 3)] >> (j & 7u)) & 1u;
    float a = kn * __half2float(k_rnorm[row]) * qjl_scale[0];
    k_sign[at] = static_cast<OT>(up ? a : -a);
}
values[at] = static_cast<OT>(__half2float(v_norm[row]) * v_centroids[tq_index(v_codes + row * VCODE_BYTES, j, VBITS, P)]);
