/* A Llama decoder's layers in one call (included by cpu_kernels.c after the products and the
 * attention kernel). Each layer makes the calls the Python layer makes, in the same order and on
 * the same buffers' values: RMSNorm and q/k/v with rotary positions, attention over the paged
 * pool, o plus the residual, RMSNorm and gate/up through the gated unit, down plus the residual.
 * So it gives the same bits; what it saves is the Python between those calls, which a decode
 * step of a small model spends as much time in as in half its products. */

/* One layer's weights, as the stack reads them. */
typedef struct {
    weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* fp32 [hidden] */
} layer_weights;

/* A step through every layer: the weights, the KV pool and the step's lanes. */
typedef struct {
    const layer_weights *layers;
    int n_layers;
    void *pool;                 /* every layer's blocks, `pool_layer` values a layer (fp16 or fp32) */
    long pool_layer;
    attention_call attention;   /* the lanes; q, new_kv, strides, pool and out are set per layer */
    const float *rotary;        /* each row's cos and sin, head_dim floats a row */
    int hidden, intermediate, tile_rows;
    float eps;
} layer_stack;

/* The scratch a step's layers pass their rows through. */
typedef struct {
    float *qkv, *attended, *mid, *gated;
} layer_rows;

static int stack_layer(const layer_stack *s, const layer_weights *l, void *pool, float *x, const layer_rows *b) {
    const attention_call *lanes = &s->attention;
    int m = lanes->batch * lanes->chunk, hd = lanes->head_dim, q_width = lanes->heads * hd;
    int qkv_width = q_width + 2 * lanes->kv_heads * hd;
    epilogue turn = {.rotary = s->rotary, .rotated = q_width + lanes->kv_heads * hd, .head_dim = hd};
    epilogue after_attention = {.residual = x}, gated = {.gated = 1}, after_mlp = {.residual = b->mid};
    attention_call at = *lanes;
    at.q = b->qkv, at.new_kv = b->qkv + q_width, at.q_stride = at.kv_stride = qkv_width;
    at.pool = pool, at.out = b->attended;
    int status = product(x, &l->qkv, b->qkv, m, qkv_width, s->hidden, s->tile_rows, l->input_norm, s->eps, &turn);
    if (status == 0)
        status = sf_paged_attention(&at);
    if (status == 0)
        status = product(b->attended, &l->o, b->mid, m, s->hidden, q_width, s->tile_rows, NULL, 0, &after_attention);
    if (status == 0)
        status = product(b->mid, &l->gate_up, b->gated, m, 2 * s->intermediate, s->hidden, s->tile_rows,
                         l->post_norm, s->eps, &gated);
    if (status == 0)
        status = product(b->gated, &l->down, x, m, s->hidden, s->intermediate, s->tile_rows, NULL, 0, &after_mlp);
    return status;
}

/* x [batch * chunk][hidden] through every layer, in place. Returns -1 where memory ran out, -2
 * for a head size the attention kernel does not take. */
int sf_llama_layers(float *x, const layer_stack *s) {
    const attention_call *lanes = &s->attention;
    size_t m = (size_t)lanes->batch * lanes->chunk, hd = lanes->head_dim;
    size_t q_width = lanes->heads * hd, qkv_width = q_width + 2 * lanes->kv_heads * hd;
    layer_rows b = {malloc(m * qkv_width * 4), malloc(m * q_width * 4), malloc(m * s->hidden * 4),
                    malloc(m * s->intermediate * 4)};
    int status = b.qkv && b.attended && b.mid && b.gated ? 0 : -1;
    for (int i = 0; status == 0 && i < s->n_layers; i++)
        status = stack_layer(s, &s->layers[i], (char *)s->pool + i * s->pool_layer * pool_unit(lanes->half), x, &b);
    free(b.qkv), free(b.attended), free(b.mid), free(b.gated);
    return status;
}
