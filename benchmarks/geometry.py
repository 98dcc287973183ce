"""The geometries the benchmarks build models at, defined once: the target (Qwen3 config.json fields) and the
drafters at that target (DSpine's and DFlash2's shapes). serving_scale writes served models from them,
train_scale and kernels build theirs from `short` (the same numbers under the names their code uses)."""
from __future__ import annotations

# Qwen3 configs as published (config.json fields); the drafter shape is SpecForge's qwen3-8b DSpine one.
GEOMETRIES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     max_position_embeddings=40960),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                     max_position_embeddings=40960),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False,
                 max_position_embeddings=4096),
}
DRAFTER = dict(layers=5, block_size=16, transfer_rank=1024, message_size=512, top_k=16, mask_token_id=151669)
TINY_DRAFTER = dict(layers=2, block_size=4, transfer_rank=16, message_size=8, top_k=4, mask_token_id=511)
# DFlash2 (SGLang >= 0.5.23, `DFlash2DraftModel` under --speculative-algorithm DFLASH): the DFlash backbone with a
# two-tap in-block convolution around every sublayer and a rank-r pairwise selector over each position's top-K.
# DFlash 2's published shape: 2 taps, 16 channels a convolution group, selector rank 256, top-K 16.
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
TINY_DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
# rope_theta as published (the served configs leave it to SGLang's default: it does not change a step's cost)
ROPE_THETA = {"qwen3-8b": 1_000_000.0, "qwen3-4b": 1_000_000.0, "tiny": 10_000.0}


def short(name: str) -> dict:
    """GEOMETRIES[name] under the short names the training and kernel benchmarks use."""
    g = GEOMETRIES[name]
    return dict(hidden=g["hidden_size"], layers=g["num_hidden_layers"], vocab=g["vocab_size"],
                heads=g["num_attention_heads"], kv_heads=g["num_key_value_heads"], head_dim=g["head_dim"],
                intermediate=g["intermediate_size"], rope_theta=ROPE_THETA[name])
