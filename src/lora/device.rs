//! Adapters on the model's device, and a step's rows grouped by adapter.

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use super::{LoraAdapter, LoraTarget};
use crate::backend::{LlamaBackend, LoraRows, upload_matrix};
use crate::config::LlamaConfig;
use crate::error::{LlamaError, Result};
use crate::model::weights::BLOCK_WEIGHTS;

/// One projection's change on the device: `x @ a @ b` is added to its output, with `a`
/// `[in, R]` and `b` `[R, out]` (the scale folded into `b`). A projection made of several
/// tensors (queries and keys) has their factors side by side: `a`'s columns are each
/// tensor's rank in turn, and `b` holds each one's rows in its own output columns
/// (zeros elsewhere, which leave the other tensor's sums as they are).
#[derive(Debug, Clone)]
pub(crate) struct LoraPair<B: Backend> {
    pub(crate) a: Tensor<B, 2>,
    pub(crate) b: Tensor<B, 2>,
}

/// A [`LoraAdapter`] on a device, as the forward pass applies it: per layer, the change
/// of each projection of the weight table ([`BLOCK_WEIGHTS`]) it changes.
#[derive(Debug, Clone)]
pub struct LoraWeights<B: Backend> {
    layers: Vec<Vec<Option<LoraPair<B>>>>,
    /// `(n_layers, d_model, ffn_hidden, q rows, kv rows)` of the model it was made for.
    shape: [usize; 5],
    fingerprint: u128,
    bytes: usize,
}

fn model_shape(c: &LlamaConfig) -> [usize; 5] {
    [
        c.n_layers,
        c.d_model,
        c.ffn_hidden,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
    ]
}

impl<B: LlamaBackend> LoraWeights<B> {
    /// Uploads `adapter` for a model of `config` on `device`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidAdapter`] if the adapter was checked against a model of
    /// another depth.
    pub fn new(adapter: &LoraAdapter, config: &LlamaConfig, device: &B::Device) -> Result<Self> {
        if adapter.n_layers() != config.n_layers {
            return Err(super::invalid(
                adapter.source(),
                format!(
                    "read for a model of {} layers, not {}",
                    adapter.n_layers(),
                    config.n_layers
                ),
            ));
        }
        let mut bytes = 0;
        let layers = (0..config.n_layers)
            .map(|layer| {
                (0..BLOCK_WEIGHTS.len())
                    .map(|weight| {
                        let parts: Vec<(LoraTarget, &super::LoraFactors)> = LoraTarget::all()
                            .filter(|t| t.weight() == weight)
                            .filter_map(|t| Some((t, adapter.factors(layer, t)?)))
                            .collect();
                        if parts.is_empty() {
                            return None;
                        }
                        let w = &BLOCK_WEIGHTS[weight];
                        let (n_in, n_out) = ((w.cols)(config), w.rows(config));
                        let rank: usize = parts.iter().map(|(_, f)| f.rank).sum();
                        let mut a = vec![0f32; n_in * rank];
                        let mut b = vec![0f32; rank * n_out];
                        let mut k0 = 0;
                        for (target, f) in parts {
                            let (t_in, t_out) = target.dims(config);
                            let col = target.column_offset(config);
                            for k in 0..f.rank {
                                for i in 0..t_in {
                                    a[i * rank + k0 + k] = f.a[k * t_in + i];
                                }
                                for o in 0..t_out {
                                    b[(k0 + k) * n_out + col + o] = f.b[o * f.rank + k] * f.scale;
                                }
                            }
                            k0 += f.rank;
                        }
                        bytes += (a.len() + b.len()) * 4;
                        Some(LoraPair {
                            a: upload_matrix::<B>(a, [n_in, rank], device),
                            b: upload_matrix::<B>(b, [rank, n_out], device),
                        })
                    })
                    .collect()
            })
            .collect();
        Ok(Self {
            layers,
            shape: model_shape(config),
            fingerprint: adapter.fingerprint(),
            bytes,
        })
    }
}

impl<B: Backend> LoraWeights<B> {
    /// The adapter's fingerprint ([`LoraAdapter::fingerprint`]).
    pub fn fingerprint(&self) -> u128 {
        self.fingerprint
    }

    /// Bytes its factors take (as f32; a half-precision device holds half).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn pair(&self, layer: usize, weight: usize) -> Option<&LoraPair<B>> {
        self.layers.get(layer)?.get(weight)?.as_ref()
    }

    /// Whether it was made for a model of `config`'s shape.
    pub fn fits(&self, config: &LlamaConfig) -> bool {
        self.shape == model_shape(config)
    }
}

/// One adapter's rows of a step: the flat token rows that use it, on the host and on the
/// device.
#[derive(Debug)]
struct Group<'a, B: Backend> {
    weights: &'a LoraWeights<B>,
    rows: Vec<u32>,
    index: Tensor<B, 1, Int>,
}

/// A step's rows grouped by adapter: what the forward pass adds to each projection's
/// output. Empty when no row uses an adapter (the pass is then the base model's alone).
#[derive(Debug)]
pub(crate) struct LoraStep<'a, B: Backend> {
    groups: Vec<Group<'a, B>>,
}

impl<'a, B: LlamaBackend> LoraStep<'a, B> {
    /// No adapter.
    pub(crate) fn none() -> Self {
        Self { groups: Vec::new() }
    }

    /// Groups flat token rows by adapter: `spans` gives each request row's token count
    /// and the index in `adapters` of its adapter, if any.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidBatch`] for an adapter index out of range or an adapter made
    /// for another model.
    pub(crate) fn new(
        adapters: &[&'a LoraWeights<B>],
        spans: impl IntoIterator<Item = (usize, Option<usize>)>,
        config: &LlamaConfig,
        device: &B::Device,
    ) -> Result<Self> {
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); adapters.len()];
        let mut at = 0u32;
        for (tokens, adapter) in spans {
            let tokens = u32::try_from(tokens)
                .map_err(|_| LlamaError::InvalidBatch("too many tokens in a step".into()))?;
            if let Some(i) = adapter {
                let group = rows.get_mut(i).ok_or_else(|| {
                    LlamaError::InvalidBatch(format!(
                        "a row names adapter {i} of {}",
                        adapters.len()
                    ))
                })?;
                group.extend(at..at + tokens);
            }
            at += tokens;
        }
        let mut groups = Vec::new();
        for (weights, rows) in adapters.iter().zip(rows) {
            if rows.is_empty() {
                continue;
            }
            if !weights.fits(config) {
                return Err(LlamaError::InvalidBatch(
                    "a LoRA adapter made for another model".into(),
                ));
            }
            let index = Tensor::from_data(
                TensorData::new(rows.iter().map(|&r| r as i64).collect(), [rows.len()]),
                device,
            );
            groups.push(Group {
                weights,
                rows,
                index,
            });
        }
        Ok(Self { groups })
    }

    /// `y` (projection `weight`'s output for `x`) with each adapter row's change added;
    /// the other rows are left as they are.
    pub(crate) fn apply(
        &self,
        layer: usize,
        weight: usize,
        x: &Tensor<B, 2>,
        y: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        let groups: Vec<LoraRows<'_, B>> = self
            .groups
            .iter()
            .filter_map(|g| {
                let pair = g.weights.pair(layer, weight)?;
                Some(LoraRows {
                    rows: &g.rows,
                    index: &g.index,
                    a: &pair.a,
                    b: &pair.b,
                })
            })
            .collect();
        if groups.is_empty() {
            return Ok(y);
        }
        B::lora_add(y, x.clone(), &groups)
    }

    /// Whether a group of the step changes projection `weight` of `layer`.
    pub(crate) fn touches(&self, layer: usize, weight: usize) -> bool {
        self.groups
            .iter()
            .any(|g| g.weights.pair(layer, weight).is_some())
    }

    /// The rows of every group that changes projection `weight` of `layer`, each group's
    /// rows with its own changes: `(rows, index, f(x rows) as changed)` for a caller that
    /// recomputes those rows apart (the fused feed-forward kernel's rows).
    pub(crate) fn groups_touching(
        &self,
        layer: usize,
        weights: [usize; 2],
    ) -> impl Iterator<Item = (&[u32], &Tensor<B, 1, Int>, LoraStep<'a, B>)> + '_ {
        self.groups
            .iter()
            .filter(move |g| weights.iter().any(|&w| g.weights.pair(layer, w).is_some()))
            .map(|g| {
                let n = g.rows.len() as u32;
                let local: Vec<u32> = (0..n).collect();
                let index = Tensor::from_data(
                    TensorData::new((0..n as i64).collect(), [n as usize]),
                    &g.index.device(),
                );
                (
                    g.rows.as_slice(),
                    &g.index,
                    LoraStep {
                        groups: vec![Group {
                            weights: g.weights,
                            rows: local,
                            index,
                        }],
                    },
                )
            })
    }
}
