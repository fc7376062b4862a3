/* Attention over the paged KV pool (nodeagent/engine/kvpool.py), included by cpu_kernels.c after a
 * build's v16 primitives. One call per layer and step: the step's new K and V are stored into
 * their slots, then every real query row attends to its lane's blocks in place, nothing copied.
 *
 * A layer's pool is K then V, each a plane per KV head holding every block in turn: a block holds
 * a head's K transposed ([head_dim][16], a key per lane) and its V as it comes ([16][head_dim]).
 * A lane whose blocks run in order is then two streams a head, which the processor's prefetchers
 * follow; blocks holding every head side by side cut them into a page at a time.
 *
 * A tile of query rows, the G heads of one KV head at consecutive positions, walks its lane's
 * blocks once: scores for 16 keys are one vector per row, a fused multiply-add per dimension, and
 * the online softmax (a running maximum, rescaled sums) takes each block in turn. Every row's
 * operations, in order, depend only on its own position and keys: a block it does not see leaves
 * its state as it was (its weights are exactly 0, the rescale exactly 1), so a row gives the same
 * bits whichever tile, chunk or build computes it, and a prompt prefilled at once decodes on
 * exactly as if it had been decoded token by token. A tile of a few rows (a decode step's G heads)
 * takes a narrower loop, which skips the unused rows' arithmetic. */

#define KV_BLOCK 16          /* tokens per block: one v16 of scores */
#define MAX_HEAD_DIM 256     /* a tile's rows stay on the stack */

typedef struct {
    const float *q;           /* [B][C] rows of `q_stride` floats, head h's query at h * head_dim */
    const float *new_kv;      /* [B][C] rows of `kv_stride` floats: K then V, [2][kv_heads][head_dim] */
    long q_stride, kv_stride;
    long plane;               /* values from one KV head's plane of the pool to the next */
    const int64_t *slots;     /* [B * C] where each row's K and V go */
    void *pool;               /* this layer's blocks, [2][kv_heads][plane]: a plane holds 16 * head_dim a block */
    const int64_t *blocks;    /* [B][table] each lane's block table */
    const int64_t *starts;    /* [B] the position of each lane's first row */
    const int64_t *counts;    /* [B] each lane's real rows; the rest are padding */
    float *out;               /* [B][C][heads * head_dim] */
    int batch, chunk, heads, kv_heads, head_dim, table, window;
    int half;                 /* the pool holds fp16 values, else fp32 */
} attention_call;

static inline size_t pool_unit(int half) {
    return half ? sizeof(uint16_t) : sizeof(float);
}

static char *block_part(const attention_call *a, int64_t block, int part, int kv_head) {
    size_t at = (size_t)(part * a->kv_heads + kv_head) * a->plane + (size_t)block * KV_BLOCK * a->head_dim;
    return (char *)a->pool + at * pool_unit(a->half);
}

/* Sixteen of the pool's values from `at` (fp16 or fp32) as floats. */
static inline __attribute__((always_inline)) v16 pool_load(const char *at, size_t index, int half) {
    return half ? v16_from_fp16((const uint16_t *)at + index) : v16_load((const float *)at + index);
}

static inline void pool_store(char *at, size_t index, float x, int half) {
    if (half)
        ((uint16_t *)at)[index] = fp16_of_float(x);
    else
        ((float *)at)[index] = x;
}

static void store_kv(const attention_call *a) {
    int hd = a->head_dim;
    for (int i = 0; i < a->batch * a->chunk; i++) {
        int64_t block = a->slots[i] / KV_BLOCK, lane = a->slots[i] % KV_BLOCK;
        for (int h = 0; h < a->kv_heads; h++) {
            const float *k = a->new_kv + i * a->kv_stride + (size_t)h * hd, *v = k + (size_t)a->kv_heads * hd;
            char *keys = block_part(a, block, 0, h), *values = block_part(a, block, 1, h);
            for (int d = 0; d < hd; d++) {
                pool_store(keys, (size_t)d * KV_BLOCK + lane, k[d], a->half);
                pool_store(values, (size_t)lane * hd + d, v[d], a->half);
            }
        }
    }
}

/* One tile's state: each row's query (scaled to log2 units), output sums, running maximum, and
 * per-lane sums of its weights. */
typedef struct {
    float q[ATTENTION_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[ATTENTION_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float p[ATTENTION_ROWS][KV_BLOCK] __attribute__((aligned(64)));
    float weights[ATTENTION_ROWS][KV_BLOCK] __attribute__((aligned(64)));
    float top[ATTENTION_ROWS];
    int from[ATTENTION_ROWS], to[ATTENTION_ROWS], row_of[ATTENTION_ROWS];
} tile_state;

/* The loops below take the tile's width, `width` rows, and the pool's kind, `half`, as constants
 * from their one caller. */
static inline __attribute__((always_inline)) void tile_scores(const tile_state *s, const char *keys, int hd,
                                                              v16 *scores, int width, int half) {
    for (int r = 0; r < width; r++)
        scores[r] = v16_set1(0);
    for (int d = 0; d < hd; d++) {
        v16 k = pool_load(keys, (size_t)d * KV_BLOCK, half);
#pragma GCC unroll 16
        for (int r = 0; r < width; r++)
            scores[r] = v16_fma(v16_set1(s->q[r][d]), k, scores[r]);
    }
}

/* Each row's weights for this block's keys, its running maximum and sums moved on; `scale` gets
 * each row's rescale of what it summed before (1 for rows that see none of the block, and for
 * the tile's unused rows). */
static void tile_softmax(tile_state *s, const v16 *scores, int rows, int first_key, float *scale) {
    float shift[KV_BLOCK] = {0};
    for (int r = 0; r < rows; r++) {
        int from = s->from[r] - first_key, to = s->to[r] - first_key;
        if (to < 0 || from >= KV_BLOCK) {
            v16_store(s->p[r], v16_set1(0));
            continue;
        }
        v16 seen = from > 0 || to < KV_BLOCK - 1 ? v16_outside(scores[r], from, to) : scores[r];
        float top = v16_max_all(seen);
        top = top > s->top[r] ? top : s->top[r];
        shift[r] = s->top[r] - top;
        s->top[r] = top;
        v16_store(s->p[r], v16_exp2(v16_sub(seen, v16_set1(top))));
    }
    v16_store(scale, v16_exp2(v16_load(shift)));
    for (int r = 0; r < rows; r++)
        v16_store(s->weights[r], v16_fma(v16_load(s->weights[r]), v16_set1(scale[r]), v16_load(s->p[r])));
}

static inline __attribute__((always_inline)) void tile_values(tile_state *s, const char *values, int hd,
                                                              const float *scale, int width, int half) {
    for (int d0 = 0; d0 < hd; d0 += KV_BLOCK) {
        v16 o[ATTENTION_ROWS];
        for (int r = 0; r < width; r++)
            o[r] = v16_mul(v16_load(s->acc[r] + d0), v16_set1(scale[r]));
        for (int t = 0; t < KV_BLOCK; t++) {
            v16 v = pool_load(values, (size_t)t * hd + d0, half);
#pragma GCC unroll 16
            for (int r = 0; r < width; r++)
                o[r] = v16_fma(v16_set1(s->p[r][t]), v, o[r]);
        }
        for (int r = 0; r < width; r++)
            v16_store(s->acc[r] + d0, o[r]);
    }
}

/* The tile's rows through blocks first..last of lane b's table, for KV head `kv_head`. */
static inline __attribute__((always_inline)) void walk_blocks(tile_state *s, const attention_call *a,
                                                              const int64_t *table, int kv_head, int rows,
                                                              int first, int last, int width, int half) {
    for (int n = first; n <= last; n++) {
        v16 scores[ATTENTION_ROWS];
        float scale[KV_BLOCK];
        tile_scores(s, block_part(a, table[n], 0, kv_head), a->head_dim, scores, width, half);
        tile_softmax(s, scores, rows, n * KV_BLOCK, scale);
        tile_values(s, block_part(a, table[n], 1, kv_head), a->head_dim, scale, width, half);
    }
}

/* Rows first_row.. (of `rows`) of lane b's query rows for KV head `kv_head`; row j is position
 * j / G's query for head kv_head * G + j % G. */
static void attend_tile(const attention_call *a, int b, int kv_head, int first_row, int rows) {
    int hd = a->head_dim, group = a->heads / a->kv_heads;
    float qscale = LOG2E / sqrtf((float)hd);
    tile_state s;
    for (int r = 0; r < ATTENTION_ROWS; r++) {
        memset(s.acc[r], 0, hd * sizeof(float));
        memset(s.p[r], 0, sizeof s.p[r]);
        memset(s.weights[r], 0, sizeof s.weights[r]);
        if (r >= rows)
            memset(s.q[r], 0, hd * sizeof(float));
    }
    for (int r = 0; r < rows; r++) {
        int j = first_row + r, c = j / group, head = kv_head * group + j % group;
        int position = (int)a->starts[b] + c;
        const float *q = a->q + ((size_t)b * a->chunk + c) * a->q_stride + (size_t)head * hd;
        for (int d = 0; d < hd; d++)
            s.q[r][d] = q[d] * qscale;
        s.top[r] = -INFINITY;
        s.to[r] = position;
        s.from[r] = a->window > 0 && position >= a->window ? position - a->window + 1 : 0;
        s.row_of[r] = (b * a->chunk + c) * a->heads + head;
    }
    const int64_t *table = a->blocks + (size_t)b * a->table;
    int first = s.from[0] / KV_BLOCK, last = s.to[rows - 1] / KV_BLOCK;
    int narrow = rows <= ATTENTION_ROWS / 2;
    if (a->half && narrow)
        walk_blocks(&s, a, table, kv_head, rows, first, last, ATTENTION_ROWS / 2, 1);
    else if (a->half)
        walk_blocks(&s, a, table, kv_head, rows, first, last, ATTENTION_ROWS, 1);
    else if (narrow)
        walk_blocks(&s, a, table, kv_head, rows, first, last, ATTENTION_ROWS / 2, 0);
    else
        walk_blocks(&s, a, table, kv_head, rows, first, last, ATTENTION_ROWS, 0);
    for (int r = 0; r < rows; r++) {
        float total = 0;
        for (int t = 0; t < KV_BLOCK; t++)
            total += s.weights[r][t];
        float *out = a->out + (size_t)s.row_of[r] * hd;
        for (int d = 0; d < hd; d++)
            out[d] = s.acc[r][d] / total;
    }
}

static int lane_tiles(const attention_call *a, int b) {
    return ((int)a->counts[b] * (a->heads / a->kv_heads) + ATTENTION_ROWS - 1) / ATTENTION_ROWS;
}

/* The tiles shared out on OpenMP's team, each lane's last (longest) first; padding rows get 0. */
static int attend_all(const attention_call *a) {
    int *first = malloc(((size_t)a->batch + 1) * sizeof(int));
    if (first == NULL)
        return -1;
    first[0] = 0;
    for (int b = 0; b < a->batch; b++) {
        first[b + 1] = first[b] + lane_tiles(a, b) * a->kv_heads;
        size_t row = (size_t)a->heads * a->head_dim;
        memset(a->out + ((size_t)b * a->chunk + a->counts[b]) * row, 0,
               (a->chunk - a->counts[b]) * row * sizeof(float));
    }
    int group = a->heads / a->kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int item = 0; item < first[a->batch]; item++) {
        int b = 0;
        while (first[b + 1] <= item)
            b++;
        int within = item - first[b], tile = lane_tiles(a, b) - 1 - within / a->kv_heads;
        int rows = (int)a->counts[b] * group - tile * ATTENTION_ROWS;
        attend_tile(a, b, within % a->kv_heads, tile * ATTENTION_ROWS, rows < ATTENTION_ROWS ? rows : ATTENTION_ROWS);
    }
    free(first);
    return 0;
}

/* Stores the step's K and V, then attends every real query row to its lane's keys (positions
 * start..its own, and no further back than `window` where it is > 0). Returns -1 where memory ran
 * out. */
int sf_paged_attention(const attention_call *call) {
    if (call->head_dim % KV_BLOCK || call->head_dim > MAX_HEAD_DIM)
        return -2;
    store_kv(call);
    return attend_all(call);
}
