"""The one tiny model shape the engine tests run: small enough for a float64 reference to
recompute in a blink, yet with what the engine must get right — grouped-query attention (4 query
heads over 2 KV heads) and three layers, so a stage split can cut inside the stack. A test that
needs another shape derives it with `dataclasses.replace` and says why."""

from nodeagent.engine.model import ModelConfig

TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
