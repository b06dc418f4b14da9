//! Embeddings: one vector per input from the model's final hidden state (after its last
//! norm), pooled over the input's tokens ([`Pooling`]) and optionally truncated and
//! normalized ([`EmbeddingOptions`]); what [`Llama::embed`] returns and the server's
//! `/v1/embeddings` sends.
//!
//! Inputs run together, left-padded into groups of at most [`GROUP_ROWS`] rows and
//! [`GROUP_TOKENS`] padded tokens, a chunk of columns per forward pass. A row's hidden
//! states depend only on its own tokens (padding is masked, positions start at each
//! row's first token, and the chunking does not change them), and each row is pooled
//! on its own in position order, so an input's vector is the same bits alone and in any
//! batch.

use crate::backend::LlamaBackend;
use crate::cache::KvCache;
use crate::error::{LlamaError, Result};
use crate::llama::Llama;
use crate::tokenizer::Tokenizer;

/// Rows run together at most.
pub const GROUP_ROWS: usize = 32;
/// Padded tokens (rows times the longest row) in one group at most, unless one input
/// alone is longer: its cache and hidden states are what a group holds at once.
pub const GROUP_TOKENS: usize = 4096;
/// Tokens (rows times columns) per forward pass.
const STEP_TOKENS: usize = 512;

/// How an input's hidden states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// The last token's hidden state: what decoder-only embedding models are trained
    /// for, since only the last token has read the whole input.
    #[default]
    Last,
    /// The mean of every token's hidden state.
    Mean,
}

impl std::str::FromStr for Pooling {
    type Err = LlamaError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "last" => Ok(Pooling::Last),
            "mean" => Ok(Pooling::Mean),
            _ => Err(LlamaError::invalid(
                "pooling",
                s,
                "must be `last` or `mean`",
            )),
        }
    }
}

/// How [`Llama::embed`] makes its vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingOptions {
    /// How the tokens' hidden states are combined.
    pub pooling: Pooling,
    /// Divide each vector by its Euclidean length (after truncation), so that dot
    /// products are cosine similarities.
    pub normalize: bool,
    /// Keep only the first `n` components (Matryoshka truncation; meaningful for models
    /// trained for it), `1..=d_model`. `None`: all of them.
    pub dimensions: Option<usize>,
}

impl Default for EmbeddingOptions {
    /// Last-token pooling, normalized, every component.
    fn default() -> Self {
        Self {
            pooling: Pooling::Last,
            normalize: true,
            dimensions: None,
        }
    }
}

impl EmbeddingOptions {
    /// These options with `pooling`.
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// These options with normalization on or off.
    pub fn with_normalize(mut self, normalize: bool) -> Self {
        self.normalize = normalize;
        self
    }

    /// These options keeping the first `dimensions` components.
    pub fn with_dimensions(mut self, dimensions: usize) -> Self {
        self.dimensions = Some(dimensions);
        self
    }

    /// The vectors' length for a model of width `d_model`.
    ///
    /// # Errors
    ///
    /// [`LlamaError::InvalidParameter`] for `dimensions` of 0 or over `d_model`.
    pub fn width(&self, d_model: usize) -> Result<usize> {
        match self.dimensions {
            None => Ok(d_model),
            Some(n) if (1..=d_model).contains(&n) => Ok(n),
            Some(n) => Err(LlamaError::invalid(
                "dimensions",
                format!("{n} (the model's width is {d_model})"),
                "must be at least 1 and at most the model's width",
            )),
        }
    }
}

/// Inputs being embedded: every group's rows, run a step at a time
/// ([`Llama::embed_step`]), so that the continuous engine runs one step between the
/// steps of its other requests and [`Llama::embed_ids`] runs them all at once.
pub(crate) struct EmbeddingJob<B: LlamaBackend> {
    options: EmbeddingOptions,
    /// The inputs not yet in a group, in order.
    inputs: std::vec::IntoIter<Vec<u32>>,
    /// The group running now.
    group: Option<Group<B>>,
    /// The finished vectors, in input order.
    done: Vec<Vec<f32>>,
    /// Inputs in all.
    total: usize,
}

/// A group of inputs run together.
struct Group<B: LlamaBackend> {
    /// Row-major `[rows, width]`, left-padded.
    tokens: Vec<u32>,
    /// Each row's first real column.
    starts: Vec<usize>,
    width: usize,
    /// Columns run so far.
    columns: usize,
    cache: KvCache<B>,
    /// Per row: the sum of its hidden states (mean pooling) or its last one.
    pooled: Vec<Vec<f64>>,
}

impl<B: LlamaBackend> EmbeddingJob<B> {
    /// The vectors, once [`Llama::embed_step`] has said the job is done.
    pub(crate) fn into_vectors(self) -> Vec<Vec<f32>> {
        self.done
    }
}

impl<B: LlamaBackend, T: Tokenizer> Llama<B, T> {
    /// One embedding per text, each encoded as a prompt
    /// ([`encode_prompt`](Self::encode_prompt), BOS included where the model wants it),
    /// in input order. The vectors are the same bits whatever the other inputs.
    ///
    /// ```no_run
    /// # fn main() -> llama_burn::Result<()> {
    /// use llama_burn::backend::{DefaultBackend, default_device};
    /// use llama_burn::embed::{EmbeddingOptions, Pooling};
    ///
    /// let llama = llama_burn::Loader::gguf(llama_burn::demo::demo_model_path()?)
    ///     .max_seq_len(1024)
    ///     .load::<DefaultBackend>(&default_device())?;
    /// let options = EmbeddingOptions::default().with_pooling(Pooling::Mean);
    /// let vectors = llama.embed(&["a cat sat", "a dog sat"], &options)?;
    /// let cosine: f32 = vectors[0].iter().zip(&vectors[1]).map(|(a, b)| a * b).sum();
    /// println!("cosine similarity {cosine:.3}");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`LlamaError::EmptyPrompt`] for an empty text or no texts,
    /// [`LlamaError::PromptTooLong`] for a text over the context window,
    /// [`LlamaError::InvalidParameter`] for a `dimensions` the model does not have.
    pub fn embed(&self, texts: &[&str], options: &EmbeddingOptions) -> Result<Vec<Vec<f32>>> {
        let ids = texts
            .iter()
            .map(|t| self.encode_prompt(t))
            .collect::<Result<Vec<_>>>()?;
        self.embed_ids(ids, options)
    }

    /// [`embed`](Self::embed) on token ids (taken as they are).
    ///
    /// # Errors
    ///
    /// As [`embed`](Self::embed), and [`LlamaError::InvalidParameter`] for a token id
    /// outside the vocabulary.
    pub fn embed_ids(
        &self,
        inputs: Vec<Vec<u32>>,
        options: &EmbeddingOptions,
    ) -> Result<Vec<Vec<f32>>> {
        let mut job = self.embedding_job(inputs, options)?;
        while !self.embed_step(&mut job)? {}
        Ok(job.into_vectors())
    }

    /// Checks `inputs` and `options` and makes a job of them for
    /// [`embed_step`](Self::embed_step); nothing runs yet.
    ///
    /// # Errors
    ///
    /// As [`embed_ids`](Self::embed_ids).
    pub(crate) fn embedding_job(
        &self,
        inputs: Vec<Vec<u32>>,
        options: &EmbeddingOptions,
    ) -> Result<EmbeddingJob<B>> {
        let c = self.config();
        options.width(c.d_model)?;
        if inputs.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        for input in &inputs {
            if input.is_empty() {
                return Err(LlamaError::EmptyPrompt);
            }
            if input.len() > c.max_seq_len {
                return Err(LlamaError::PromptTooLong {
                    tokens: input.len(),
                    max: c.max_seq_len,
                });
            }
            c.check_token_ids(input)?;
        }
        Ok(EmbeddingJob {
            options: *options,
            total: inputs.len(),
            inputs: inputs.into_iter(),
            group: None,
            done: Vec::new(),
        })
    }

    /// Runs the next forward pass of `job` (a chunk of its current group's columns,
    /// starting the next group when none runs) and returns whether every input is
    /// embedded.
    ///
    /// # Errors
    ///
    /// A failed forward pass.
    pub(crate) fn embed_step(&self, job: &mut EmbeddingJob<B>) -> Result<bool> {
        if job.done.len() == job.total {
            return Ok(true);
        }
        let d_model = self.config().d_model;
        let group = match &mut job.group {
            Some(group) => group,
            None => job.group.insert(self.next_group(&mut job.inputs)?),
        };
        let rows = group.starts.len();
        let step = (STEP_TOKENS / rows).max(1);
        let from = group.columns;
        let to = (from + step).min(group.width);
        let chunk: Vec<u32> = (0..rows)
            .flat_map(|r| group.tokens[r * group.width + from..r * group.width + to].to_vec())
            .collect();
        let hidden = self.model.forward_hidden(&chunk, &mut group.cache)?;
        let hidden = crate::llama::logits_to_vec(hidden)?;
        let seq = to - from;
        for (r, pooled) in group.pooled.iter_mut().enumerate() {
            // Mean pooling adds every real column's state in order; last-token pooling
            // takes the last column's.
            let columns = match job.options.pooling {
                Pooling::Mean => from.max(group.starts[r])..to,
                Pooling::Last if to == group.width => to - 1..to,
                Pooling::Last => to..to,
            };
            for column in columns {
                let at = (r * seq + column - from) * d_model;
                let state = &hidden[at..at + d_model];
                match job.options.pooling {
                    Pooling::Mean => {
                        for (sum, &v) in pooled.iter_mut().zip(state) {
                            *sum += f64::from(v);
                        }
                    }
                    Pooling::Last => {
                        for (last, &v) in pooled.iter_mut().zip(state) {
                            *last = f64::from(v);
                        }
                    }
                }
            }
        }
        group.columns = to;
        if to == group.width {
            let group = job
                .group
                .take()
                .ok_or_else(|| LlamaError::Runtime("an embedding group went missing".into()))?;
            for (r, pooled) in group.pooled.into_iter().enumerate() {
                let count = (group.width - group.starts[r]) as f64;
                job.done.push(finish(pooled, count, &job.options));
            }
        }
        Ok(job.done.len() == job.total)
    }

    /// The next group of inputs: up to [`GROUP_ROWS`] in order, while the padded size
    /// stays within [`GROUP_TOKENS`] (always at least one).
    fn next_group(&self, inputs: &mut std::vec::IntoIter<Vec<u32>>) -> Result<Group<B>> {
        let mut rows: Vec<Vec<u32>> = Vec::new();
        let mut width = 0;
        while rows.len() < GROUP_ROWS {
            let Some(next) = inputs.as_slice().first() else {
                break;
            };
            let wider = width.max(next.len());
            if !rows.is_empty() && wider * (rows.len() + 1) > GROUP_TOKENS {
                break;
            }
            width = wider;
            rows.extend(inputs.next());
        }
        if rows.is_empty() {
            return Err(LlamaError::EmptyPrompt);
        }
        let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
        let (tokens, starts) = crate::inference::batched::left_pad(&refs);
        let d_model = self.config().d_model;
        Ok(Group {
            pooled: vec![vec![0.0; d_model]; rows.len()],
            cache: self.model.new_cache(starts.clone(), width),
            tokens,
            starts,
            width,
            columns: 0,
        })
    }
}

/// A row's vector from its pooled sums: the mean for mean pooling (`count` tokens),
/// truncated, then normalized if asked.
fn finish(pooled: Vec<f64>, count: f64, options: &EmbeddingOptions) -> Vec<f32> {
    let scale = match options.pooling {
        Pooling::Mean => 1.0 / count,
        Pooling::Last => 1.0,
    };
    let width = options.dimensions.unwrap_or(pooled.len()).min(pooled.len());
    let mut v: Vec<f64> = pooled[..width].iter().map(|x| x * scale).collect();
    if options.normalize {
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 0.0 {
            for x in &mut v {
                *x /= norm;
            }
        }
    }
    v.into_iter().map(|x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_means_truncates_then_normalizes() {
        let options = EmbeddingOptions {
            pooling: Pooling::Mean,
            normalize: true,
            dimensions: Some(2),
        };
        // The mean of two tokens is [1.5, 2, 0.5]; truncated to [1.5, 2], length 2.5.
        assert_eq!(finish(vec![3.0, 4.0, 1.0], 2.0, &options), vec![0.6, 0.8]);
        let raw = EmbeddingOptions::default().with_normalize(false);
        assert_eq!(finish(vec![3.0, 4.0], 7.0, &raw), vec![3.0, 4.0]);
        // A zero vector stays zero rather than becoming NaN.
        assert_eq!(
            finish(vec![0.0; 3], 1.0, &EmbeddingOptions::default()),
            vec![0.0; 3]
        );
    }

    #[test]
    fn dimensions_outside_the_model_are_refused_by_name() {
        for n in [0, 65] {
            match EmbeddingOptions::default().with_dimensions(n).width(64) {
                Err(LlamaError::InvalidParameter { name, .. }) => assert_eq!(name, "dimensions"),
                other => panic!("{n}: {other:?}"),
            }
        }
        assert_eq!(
            EmbeddingOptions::default()
                .with_dimensions(64)
                .width(64)
                .ok(),
            Some(64)
        );
        assert_eq!("mean".parse::<Pooling>().ok(), Some(Pooling::Mean));
        assert!(matches!(
            "max".parse::<Pooling>(),
            Err(LlamaError::InvalidParameter { .. })
        ));
    }
}
