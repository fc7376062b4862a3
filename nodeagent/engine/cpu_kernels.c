/* The node's quantized CPU kernels, int4 and int8 weights in groups of 32, in integer arithmetic.
 * Two builds of this file, loaded by nodeagent/engine/cpu_kernels.py: AVX-512 VNNI for calls of a
 * few rows and AMX int8 tiles for more (cpu_kernels_avx512.h), or AVX2 for every call
 * (cpu_kernels_avx2.h, built with SF_AVX2). This file holds what they share: the layouts, the
 * vector path's threads and the entry points.
 *
 * Every sum is an exact integer, so every path gives the same bits and a row's products never
 * depend on the rows beside it (decode and a prefill of the same tokens agree to the bit):
 * - each group of 32 activations a becomes q = round(a / step), step = max|a| / QMAX, split as
 *   q = 16 * high + low with both in int8 (12 bits in all);
 * - per group and output, the codes c give D = 16 * sum(high * c) + sum(low * c) = sum(q * c)
 *   exactly in int32 (int4 on the tiles: one product of [high, low] by [16 c, c]);
 * - the group then adds step * scale * D (int8: w = scale * c) or step * (scale * D + minimum *
 *   sum(q)) (int4: w = scale * c + minimum) to each output, one fixed order of fp32 operations;
 *   scales and minimums come in fp16, as GGUF keeps them.
 *
 * Codes come in the kernels' own layouts (`pack_int4`, `pack_int8` in cpu_kernels.py), 64 bytes
 * for each 16 outputs: int4 by 8 inputs, byte 4 i + j holding output i's code at input j (low
 * nibble) and j + 4 (high); int8 by 4 inputs, byte 4 i + j holding output i's code at input j.
 * Scales too (`pack_scales`): each 16 outputs' scales group after group, so that one row's
 * product reads its weight in two streams.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GROUP 32               /* inputs per scale */
#define QUADS (GROUP / 4)      /* 4-input steps of a group: one VNNI lane, one tile row */
#define UNIT 64                /* bytes of codes for 16 outputs: 8 inputs of int4, 4 of int8 */
#define SPLIT_BITS 4           /* q = 2^SPLIT_BITS * high + low */
#define QMAX 2039.0f           /* |q| whose high byte still fits int8: 127 * 16 + 7 */
#define VECTOR_ROWS 4          /* rows the vector path takes a column tile for at once */
#define PREFETCH 2048          /* bytes of codes the vector path asks for ahead of its loads */
#define CHUNKS_PER_THREAD 4    /* the vector path's chunks of work per thread */
#define SHARED_ROWS 16         /* calls of this many rows norm and quantize them on the whole team */

/* A weight: codes, fp16 scales and its code width. For each 16 outputs (a column tile) the scales
 * run group by group, 16 scales and for int4 then 16 minimums: a tile's scales are one stream. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    int bits;
} weight;

/* fp16 values a group holds for each 16 outputs: scale, and for int4 minimum. */
static inline int parts(const weight *w) {
    return w->bits == 4 ? 2 : 1;
}

static inline const uint16_t *group_scales(const weight *w, int t, int groups, int g) {
    return w->scales + ((size_t)t * groups + g) * parts(w) * 16;
}

/* The activations quantized per group: for each row and group 64 bytes, the 32 highs of q then
 * the 32 lows ([m][2 k]), and per [m][k / GROUP] the step and sum(q). */
typedef struct {
    int8_t *halves;
    float *step, *total;
} activations;

static size_t column_tile_bytes(int bits, int k_all) {
    return (size_t)k_all * 16 * bits / 8;
}

/* A group's codes, asked for PREFETCH bytes ahead: a one-row product streams its weight at near
 * the memory's pace only with the loads requested this early; past a weight's end they are
 * harmless (a prefetch never faults). Inlined by force: GCC takes a function that only
 * prefetches for one without effects and drops calls to it. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *codes, int bits) {
    for (int o = 0; o < GROUP * bits * 2; o += 64)
        _mm_prefetch((const char *)codes + PREFETCH + o, _MM_HINT_T0);
}

/* 2^f = e^(f ln 2) for |f| <= 1/2 as its Taylor polynomial to f^7 (relative error below 1e-8), and
 * the least x whose 2^x is taken as normal: the attention kernel's softmax weights. */
static const float EXP2_TERMS[8] = {1.0f, 0.6931471805599453f, 0.2402265069591007f, 0.05550410866482158f,
                                    0.009618129107628477f, 0.0013333558146428443f, 0.00015403530393381606f,
                                    1.525273380405984e-05f};
#define EXP2_FLOOR -126.0f
#define LOG2E 1.4426950408889634f

#ifdef SF_AVX2
#include "cpu_kernels_avx2.h"
#else
#include "cpu_kernels_avx512.h"
#endif

static void vector_rows(const activations *a, const weight *w, int t, float *y, int m, int n, int k_all) {
    for (int r0 = 0; r0 < m; r0 += VECTOR_ROWS) {
        int rows = m - r0 < VECTOR_ROWS ? m - r0 : VECTOR_ROWS;
        if (w->bits == 4) {
            switch (rows) {
            case 1: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 1, n, k_all); break;
            case 2: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 2, n, k_all); break;
            case 3: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 3, n, k_all); break;
            default: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 4, n, k_all);
            }
        } else {
            switch (rows) {
            case 1: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 1, n, k_all); break;
            case 2: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 2, n, k_all); break;
            case 3: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 3, n, k_all); break;
            default: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 4, n, k_all);
            }
        }
    }
}

/* The vector path: the rows quantized, then the column tiles shared out on OpenMP's team in
 * chunks that its threads claim as they come free. Called from the node's scheduler thread, that
 * team is the one torch's own ops run on, whose workers spin a while after each op: they pick the
 * call up at once, and no second set of threads competes with them for the cores. */
static void vectored(const float *x, const activations *a, const weight *w, float *y, int m, int n, int k_all) {
    int tiles = n / 16, most = CHUNKS_PER_THREAD * omp_get_max_threads();
    int chunks = tiles < most ? tiles : most;
    int shared = m >= SHARED_ROWS;
    for (int r = 0; !shared && r < m; r++)
        quantize_row(x, a, r, k_all);
#pragma omp parallel
    {
        if (shared) {
#pragma omp for schedule(static)
            for (int r = 0; r < m; r++)
                quantize_row(x, a, r, k_all);
        }
#pragma omp for schedule(dynamic, 1)
        for (int chunk = 0; chunk < chunks; chunk++)
            for (int t = tiles * chunk / chunks; t < tiles * (chunk + 1) / chunks; t++)
                vector_rows(a, w, t, y, m, n, k_all);
    }
}

#define SQUARE_LANES 8  /* partial sums of an RMSNorm's squares, added in a fixed order */

/* Each row of x scaled to a root mean square of one and times `norm` (RMSNorm), into `out`. The
 * squares add up in double, in one fixed order, so the scale is near exact and every build gives
 * the same bits. */
static void rms_normed(const float *x, const float *norm, float eps, float *out, int m, int k_all) {
#pragma omp parallel for schedule(static) if (m >= SHARED_ROWS)
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * k_all;
        double lanes[SQUARE_LANES] = {0}, squares = 0;
        for (int i = 0; i < k_all; i += SQUARE_LANES)
            for (int l = 0; l < SQUARE_LANES; l++)
                lanes[l] += (double)row[i + l] * row[i + l];
        for (int l = 0; l < SQUARE_LANES; l++)
            squares += lanes[l];
        float scale = (float)(1.0 / sqrt(squares / k_all + eps));
        for (int i = 0; i < k_all; i++)
            out[(size_t)r * k_all + i] = row[i] * scale * norm[i];
    }
}

/* What a product does to each row once its sums are in. */
typedef struct {
    const float *rotary;  /* each row's cos and sin of its pairs' angles: head_dim floats a row */
    int rotated;          /* a row's leading outputs turned by them, head after head (0: none) */
    int head_dim;
    int gated;            /* nonzero: a row's n sums become silu(first half) * second half, n / 2 */
    const float *residual; /* added to each row of the result, as wide as it (NULL: nothing) */
} epilogue;

/* f as computed, a value GCC may not fuse into the sum it feeds. */
static inline __attribute__((always_inline)) float pinned(float f) {
    __asm__("" : "+x"(f));
    return f;
}

/* Rotary positions: each pair (a, b) of the first `rotated` outputs times cos + i sin, the four
 * products each rounded before their sums, as torch's complex product rounds them. */
static void rotate_row(float *y, const float *rotary, int rotated, int head_dim) {
    for (float *head = y; head < y + rotated; head += head_dim)
        for (int i = 0; i < head_dim; i += 2) {
            float a = head[i], b = head[i + 1], cos = rotary[i], sin = rotary[i + 1];
            head[i] = pinned(a * cos) - pinned(b * sin);
            head[i + 1] = pinned(a * sin) + pinned(b * cos);
        }
}

/* silu(gate) * up over n values (a multiple of 16): gate / (1 + e^-gate), written with e^-|gate|
 * from the attention kernel's exp2 so that both builds give the same bits. */
static void gate_row(const float *gate, const float *up, float *out, int n) {
    for (int i = 0; i < n; i += 16) {
        v16 g = v16_load(gate + i);
        v16 e = v16_exp2(v16_mul(v16_abs(g), v16_set1(-LOG2E)));
        v16 share = v16_div(v16_by_sign(g, v16_mul(g, e), g), v16_add(v16_set1(1.0f), e));
        v16_store(out + i, v16_mul(share, v16_load(up + i)));
    }
}

/* `then` on each row of sums [m][n]; gated rows land in y [m][n / 2]. */
static void epilogue_rows(const epilogue *then, float *sums, float *y, int m, int n) {
    int width = then->gated ? n / 2 : n;
#pragma omp parallel for schedule(static) if (m >= SHARED_ROWS)
    for (int r = 0; r < m; r++) {
        float *row = sums + (size_t)r * n, *out = y + (size_t)r * width;
        if (then->rotated)
            rotate_row(row, then->rotary + (size_t)r * then->head_dim, then->rotated, then->head_dim);
        if (then->gated)
            gate_row(row, row + n / 2, out, n / 2);
        if (then->residual != NULL)
            for (int i = 0; i < width; i++)
                out[i] += then->residual[(size_t)r * width + i];
    }
}

static int product(const float *x, const weight *w, float *y, int m, int n, int k_all, int tile_rows,
                   const float *norm, float eps, const epilogue *then) {
    int groups = k_all / GROUP, status = 0, gated = then != NULL && then->gated;
    activations a = {malloc((size_t)m * k_all * 2), malloc((size_t)m * groups * 4), malloc((size_t)m * groups * 4)};
    float *normed = norm == NULL ? NULL : malloc((size_t)m * k_all * 4);
    float *ungated = gated ? malloc((size_t)m * n * 4) : NULL, *sums = gated ? ungated : y;
    if (a.halves == NULL || a.step == NULL || a.total == NULL || (norm != NULL && normed == NULL) || sums == NULL) {
        free(a.halves), free(a.step), free(a.total), free(normed), free(ungated);
        return -1;
    }
    if (norm != NULL) {
        rms_normed(x, norm, eps, normed, m, k_all);
        x = normed;
    }
#ifdef HAS_TILES
    if (m >= tile_rows)
        status = tiled(x, &a, w, sums, m, n, k_all);
    else
#endif
        vectored(x, &a, w, sums, m, n, k_all);
    if (then != NULL && status == 0)
        epilogue_rows(then, sums, y, m, n);
    free(a.halves), free(a.step), free(a.total), free(normed), free(ungated);
    return status;
}

/* y[m, n] = x[m, k_all] @ W.T in fp32, w = scale * code + minimum with codes 0..15, the scales laid
 * out as `weight` says. Where `norm` is not NULL, x's rows are RMSNormed with it (and `eps`) first;
 * where `then` is not NULL, each row of y goes through it (y is then [m, n / 2] if gated). Calls of
 * `tile_rows` rows or more take the tile path (pass more rows than any call has where the process
 * has no tiles). Returns -1 where memory ran out. */
int sf_int4_mm(const float *x, const uint8_t *codes, const uint16_t *scales, float *y, int m, int n, int k_all,
               int tile_rows, const float *norm, float eps, const epilogue *then) {
    weight w = {codes, scales, 4};
    return product(x, &w, y, m, n, k_all, tile_rows, norm, eps, then);
}

/* The same for int8: w = scale * code, codes -128..127. */
int sf_int8_mm(const float *x, const int8_t *codes, const uint16_t *scales, float *y, int m, int n, int k_all,
               int tile_rows, const float *norm, float eps, const epilogue *then) {
    weight w = {(const uint8_t *)codes, scales, 8};
    return product(x, &w, y, m, n, k_all, tile_rows, norm, eps, then);
}

/* x's row r times output o of an int8 weight in the kernels' layout, in fp32: each group's codes
 * times x lane by lane, scaled and summed across groups in 16 lanes, then the lanes in order. */
static float chosen_product(const float *x, const weight *w, int64_t o, int k_all) {
    int groups = k_all / GROUP, t = (int)(o / 16), lane = (int)(o % 16);
    const uint8_t *codes = w->codes + t * column_tile_bytes(w->bits, k_all) + 4 * lane;
    v16 acc = v16_set1(0);
    for (int g = 0; g < groups; g++) {
        int8_t group[GROUP];
        for (int p = 0; p < QUADS; p++)
            memcpy(group + 4 * p, codes + (size_t)(g * QUADS + p) * UNIT, 4);
        v16 part = v16_mul(v16_from_int8(group), v16_load(x + g * GROUP));
        part = v16_fma(v16_from_int8(group + 16), v16_load(x + g * GROUP + 16), part);
        acc = v16_fma(v16_set1(float_of_fp16(group_scales(w, t, groups, g)[lane])), part, acc);
    }
    float lanes[16], total = 0;
    v16_store(lanes, acc);
    for (int l = 0; l < 16; l++)
        total += lanes[l];
    return total;
}

/* out[r][j] = x[r] . w[top[r][j]] for `chosen` outputs a row of x [m][k_all], w = scale * code an
 * int8 weight in the kernels' layout: the int8 lm_head's exact products for its top logits. */
void sf_int8_chosen(const float *x, const int8_t *codes, const uint16_t *scales, const int64_t *top, float *out,
                    int m, int chosen, int k_all) {
    weight w = {(const uint8_t *)codes, scales, 8};
#pragma omp parallel for schedule(static) if (m * chosen >= 64)
    for (int i = 0; i < m * chosen; i++)
        out[i] = chosen_product(x + (size_t)(i / chosen) * k_all, &w, top[i], k_all);
}

#include "cpu_attention.h"
#include "cpu_layers.h"
