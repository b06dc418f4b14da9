//! Grouped-query self-attention over the KV cache.

use burn::tensor::{Tensor, backend::Backend, module::attention, ops::AttentionModuleOptions};

use crate::cache::KvCache;

/// Attention for one layer: `q` is `[batch, n_heads, seq, head_dim]` (RoPE applied),
/// `k`/`v` are this chunk's `[batch, n_kv_heads, seq, head_dim]` (RoPE applied to `k`).
/// Writes `k`/`v` into the cache and returns `[batch, seq, n_heads * head_dim]`.
///
/// Query heads that share a key/value head are folded into the query axis
/// (`[batch, n_kv_heads, groups * seq, head_dim]`), so keys and values are never
/// repeated and the backend's fused attention kernel sees matching head counts.
pub fn grouped_query_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    cache: &mut KvCache<B>,
    layer: usize,
    mask: Option<&Tensor<B, 4, burn::tensor::Bool>>,
) -> Tensor<B, 3> {
    let [batch, n_heads, seq, head_dim] = q.dims();
    let n_kv = k.dims()[1];
    let groups = n_heads / n_kv;
    let (keys, values) = cache.write(layer, k, v);
    let q = q.reshape([batch, n_kv, groups * seq, head_dim]);
    let out = attention(
        q,
        keys,
        values,
        mask.cloned(),
        None,
        AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: false,
        },
    );
    out.reshape([batch, n_heads, seq, head_dim])
        .swap_dims(1, 2)
        .reshape([batch, seq, n_heads * head_dim])
}
