//! `generate_batch`: the batched strategy in one call.

use crate::backend::LlamaBackend;

use crate::error::{LlamaError, Result};
use crate::llama::Llama;
use crate::sampling::{Sampler, TopP, validate_temperature, validate_top_p};
use crate::tokenizer::Tokenizer;

/// Largest number of rows [`generate_batch`] puts in one forward pass.
pub const DEFAULT_MAX_BATCH: usize = 32;

/// Generates up to `max_tokens` tokens for every prompt, batched, and returns each
/// prompt's generated text pieces in order. Row `i` samples with its own seed
/// `seed + i`, so results do not depend on how rows are grouped. Temperature 0 is
/// greedy. Batches larger than [`DEFAULT_MAX_BATCH`] are split.
///
/// ```no_run
/// # fn main() -> llama_burn::Result<()> {
/// use llama_burn::{backend::{DefaultBackend, default_device}, llama::LlamaConfig};
/// use llama_burn::inference::generate_batch;
///
/// let path = llama_burn::demo::demo_model_path()?;
/// let mut llama = LlamaConfig::load_gguf::<DefaultBackend>(path, 1024, &default_device())?;
/// let prompts = ["What is the capital of France?", "Explain quantum computing."];
/// let results = generate_batch(&mut llama, &prompts, 50, 0.7, 0.9, 42)?;
/// for (prompt, pieces) in prompts.iter().zip(&results) {
///     println!("{prompt}: {}", pieces.concat());
/// }
/// # Ok(())
/// # }
/// ```
pub fn generate_batch<B: LlamaBackend, T: Tokenizer, S: AsRef<str>>(
    llama: &mut Llama<B, T>,
    prompts: &[S],
    max_tokens: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
) -> Result<Vec<Vec<String>>> {
    generate_batch_with_max(
        llama,
        prompts,
        max_tokens,
        temperature,
        top_p,
        seed,
        DEFAULT_MAX_BATCH,
    )
}

/// [`generate_batch`] with an explicit largest batch size.
pub fn generate_batch_with_max<B: LlamaBackend, T: Tokenizer, S: AsRef<str>>(
    llama: &mut Llama<B, T>,
    prompts: &[S],
    max_tokens: usize,
    temperature: f64,
    top_p: f64,
    seed: u64,
    max_batch: usize,
) -> Result<Vec<Vec<String>>> {
    validate_temperature(temperature)?;
    validate_top_p(top_p)?;
    if max_batch == 0 {
        return Err(LlamaError::invalid("max_batch", 0, "must be at least 1"));
    }
    if prompts.is_empty() {
        return Err(LlamaError::InvalidBatch("no prompts given".into()));
    }
    // Validate every prompt before running any, so a bad row fails fast.
    let ids = prompts
        .iter()
        .map(|p| llama.encode_prompt(p.as_ref()))
        .collect::<Result<Vec<_>>>()?;
    let mut results = Vec::with_capacity(prompts.len());
    for (chunk_index, chunk) in ids.chunks(max_batch).enumerate() {
        let first_row = chunk_index * max_batch;
        let mut state = llama.create_batched_generation_state_from_ids(
            chunk.to_vec(),
            vec![max_tokens; chunk.len()],
        )?;
        let mut samplers: Vec<Sampler> = (0..chunk.len())
            .map(|i| Sampler::TopP(TopP::new(top_p, seed.wrapping_add((first_row + i) as u64))))
            .collect();
        let mut pieces = vec![Vec::new(); chunk.len()];
        while !state.is_done() {
            let steps =
                llama.generate_batched_single_token(&mut state, temperature, &mut samplers)?;
            for (row, step) in steps.into_iter().enumerate() {
                if let Some((_, piece, _)) = step
                    && !piece.is_empty()
                {
                    pieces[row].push(piece);
                }
            }
        }
        results.extend(pieces);
    }
    Ok(results)
}
