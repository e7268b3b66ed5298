// TurboQuant kernels for mx.fast.metal_kernel (loaded by metal/kernels.py).
//
// Bit layout (services/core/kv/packing.py): the indices of one vector of P coordinates
// are one byte row made of planes whose widths divide 8, so no index straddles a byte:
//   1 bit: [1-bit plane, P/8 bytes]   2 bits: [2-bit plane, P/4 bytes]
//   3 bits: [2-bit plane (low bits), P/4 bytes][1-bit plane (high bit), P/8 bytes]
//   4 bits: [nibbles, P/2 bytes]
// Coordinate j of a plane of width w sits in byte j / (8/w), bits (j % (8/w)) * w.
// QJL signs are one more 1-bit plane: bit j set <=> (S r)_j >= 0.
//
// Sections are separated by lines "//// <name>"; "header" is shared by all kernels.

//// header
inline uint tq_index(const device uint8_t* row, uint j, int bits, uint P) {
    if (bits == 4) return (row[j >> 1] >> ((j & 1u) * 4u)) & 15u;
    if (bits == 2) return (row[j >> 2] >> ((j & 3u) * 2u)) & 3u;
    if (bits == 1) return (row[j >> 3] >> (j & 7u)) & 1u;
    uint low = (row[j >> 2] >> ((j & 3u) * 2u)) & 3u;
    uint high = (row[P / 4 + (j >> 3)] >> (j & 7u)) & 1u;
    return low | (high << 2);
}

//// pack
// One threadgroup of P threads per vector. Inputs: x [N, D] float, rotation [P, P]
// (row-major, y = x_pad @ rotation), boundaries [2^BITS - 1], centroids [2^BITS],
// qjl_t [P, P] (S^T).
// Outputs: norm [N] half, codes [N, CODE_BYTES] uint8, residual_norm [N] half,
// signs [N, P/8] uint8. Template: P, D, BITS, QJL, CODE_BYTES.
uint n = threadgroup_position_in_grid.x;
uint j = thread_position_in_threadgroup.x;
threadgroup float unit[P];
threadgroup float residual[P];
threadgroup uint idx[P];
threadgroup float partial[P];

float xj = j < (uint)D ? float(x[n * D + j]) : 0.0f;
partial[j] = xj * xj;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint stride = P / 2; stride > 0; stride >>= 1) {
    if (j < stride) partial[j] += partial[j + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
float nrm = sqrt(partial[0]);
float inv = 1.0f / max(nrm, 1e-12f);
threadgroup_barrier(mem_flags::mem_threadgroup);
unit[j] = xj * inv;
threadgroup_barrier(mem_flags::mem_threadgroup);
float y = 0.0f;
for (uint i = 0; i < (uint)D; ++i) y += unit[i] * rotation[i * P + j];
uint k = 0;
for (uint b = 0; b < (1u << BITS) - 1; ++b) k += y > boundaries[b] ? 1u : 0u;
idx[j] = k;
residual[j] = y - centroids[k];
threadgroup_barrier(mem_flags::mem_threadgroup);
device uint8_t* row = codes + n * CODE_BYTES;
if (BITS == 4) {
    if (j < P / 2) row[j] = uint8_t(idx[2 * j] | (idx[2 * j + 1] << 4));
} else if (BITS == 1) {
    if (j < P / 8) { uint v = 0; for (uint t = 0; t < 8; ++t) v |= (idx[8 * j + t] & 1u) << t; row[j] = uint8_t(v); }
} else {
    if (j < P / 4) { uint v = 0; for (uint t = 0; t < 4; ++t) v |= (idx[4 * j + t] & 3u) << (2 * t); row[j] = uint8_t(v); }
    if (BITS == 3 && j < P / 8) {
        uint v = 0; for (uint t = 0; t < 8; ++t) v |= ((idx[8 * j + t] >> 2) & 1u) << t;
        row[P / 4 + j] = uint8_t(v);
    }
}
if (j == 0) norm[n] = half(nrm);
threadgroup_barrier(mem_flags::mem_threadgroup);  // idx is reused below
if (QJL) {
    partial[j] = residual[j] * residual[j];
    float s = 0.0f;
    for (uint i = 0; i < (uint)P; ++i) s += residual[i] * qjl_t[i * P + j];
    idx[j] = s >= 0.0f ? 1u : 0u;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint stride = P / 2; stride > 0; stride >>= 1) {
        if (j < stride) partial[j] += partial[j + stride];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (j < P / 8) { uint v = 0; for (uint t = 0; t < 8; ++t) v |= idx[8 * j + t] << t; signs[n * (P / 8) + j] = uint8_t(v); }
    if (j == 0) residual_norm[n] = half(sqrt(partial[0]));
}

//// scores
// scores[g, l, t] = norm[g,t] * (sum_j q[g,l,j] c[idx_j] + qjl_scale * rnorm[g,t] * sum_j sq[g,l,j] sgn_j)
// q: rotated queries [G, L, P]; sq: q @ S^T [G, L, P] (unused without QJL); codes
// [G, T, CODE_BYTES]; norm, residual_norm [G, T] half; signs [G, T, P/8].
// Grid (T, L, G): one thread per score. Template: P, BITS, QJL, CODE_BYTES.
uint t = thread_position_in_grid.x;
uint l = thread_position_in_grid.y;
uint g = thread_position_in_grid.z;
uint T = norm_shape[1];
uint L = queries_shape[1];
if (t >= T) return;
const device uint8_t* row = codes + (g * T + t) * CODE_BYTES;
const device float* qrow = queries + (g * L + l) * P;
float acc = 0.0f;
for (uint j = 0; j < (uint)P; ++j) acc += qrow[j] * centroids[tq_index(row, j, BITS, P)];
if (QJL) {
    const device uint8_t* srow = signs + (g * T + t) * (P / 8);
    const device float* sq = projected + (g * L + l) * P;
    float qjl = 0.0f;
    for (uint j = 0; j < (uint)P; ++j) qjl += ((srow[j >> 3] >> (j & 7u)) & 1u) ? sq[j] : -sq[j];
    acc += qjl_scale[0] * float(residual_norm[g * T + t]) * qjl;
}
scores[(g * L + l) * T + t] = acc * float(norm[g * T + t]);

//// values
// out[g, l, j] = sum_t w[g, l, t] * norm[g, t] * c[idx(t, j)], still rotated.
// weights [G, L, T] float; codes [G, T, CODE_BYTES]; norm [G, T] half.
// Grid (P, L, G): one thread per output coordinate. Template: P, BITS, CODE_BYTES.
uint j = thread_position_in_grid.x;
uint l = thread_position_in_grid.y;
uint g = thread_position_in_grid.z;
uint T = norm_shape[1];
uint L = weights_shape[1];
const device float* w = weights + (g * L + l) * T;
float acc = 0.0f;
for (uint t = 0; t < T; ++t) {
    const device uint8_t* row = codes + (g * T + t) * CODE_BYTES;
    acc += w[t] * float(norm[g * T + t]) * centroids[tq_index(row, j, BITS, P)];
}
out[(g * L + l) * P + j] = acc;
