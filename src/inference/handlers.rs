//! The two streaming handlers of the job runtime.
//!
//! Both take a [`GenerateRequest`], validate it (a bad request fails its own job and
//! nothing else), and emit one [`TokenOutput`] per generated token, the final stop token
//! included (with empty text), so the emitted ids are exactly those of
//! [`Llama::generate`](crate::llama::Llama::generate).

use crate::backend::LlamaBackend;

use super::request::{GenerateRequest, TokenOutput};
use super::runtime::{CancelToken, In, ModelAccessor, ModelDevice, OutStream};
use crate::error::{LlamaError, Result};
use crate::llama::{GenerationState, Llama};
use crate::sampling::{Pipeline, Sampler};
use crate::tokenizer::Tokenizer;

impl<B: LlamaBackend, T: Tokenizer> ModelDevice for Llama<B, T> {
    type Device = B::Device;

    fn devices(&self) -> Vec<B::Device> {
        vec![self.device().clone()]
    }
}

/// The sampler a request asks for: the [`Pipeline`] of its sampling controls
/// ([`GenerateRequest::sampling`], read as they are), seeded with its seed. Its controls
/// are checked once, by [`GenerateRequest::validate`] (or, passed to a method of
/// [`Llama`] that takes a sampler, by that method). It has no constraint: the strategies
/// use [`constrained_sampler`], which compiles the request's
/// [`constraint`](GenerateRequest::constraint) against the model.
pub fn request_sampler(request: &GenerateRequest) -> Sampler {
    Sampler::Pipeline(Pipeline::unchecked(request.sampling.clone(), request.seed))
}

/// The sampler a request asks for with its constraint, if any, compiled against
/// `llama` ([`Llama::compile_constraint`]): what every strategy samples through.
///
/// # Errors
///
/// [`LlamaError::InvalidConstraint`] when the constraint does not compile.
pub fn constrained_sampler<B: LlamaBackend, T: Tokenizer>(
    llama: &Llama<B, T>,
    request: &GenerateRequest,
) -> Result<Sampler> {
    let constraint = match request.constraint.as_deref() {
        Some(constraint) => Some(llama.compile_constraint(constraint)?),
        None => None,
    };
    Ok(sampler_with(request, constraint))
}

/// The sampler of `request` with `constraint`, its constraint compiled already (by
/// [`constrained_sampler`], or by the continuous engine's submitter).
pub(crate) fn sampler_with(
    request: &GenerateRequest,
    constraint: Option<crate::constraints::ConstraintState>,
) -> Sampler {
    let pipeline = Pipeline::unchecked(request.sampling.clone(), request.seed);
    Sampler::Pipeline(match constraint {
        Some(state) => pipeline.with_constraint(state),
        None => pipeline,
    })
}

/// Validates `request` against the model (once: nothing downstream checks its values
/// again) and prepares its state.
fn prepare<B: LlamaBackend, T: Tokenizer>(
    llama: &Llama<B, T>,
    request: &GenerateRequest,
) -> Result<GenerationState<B>> {
    request.validate(llama.config().max_seq_len)?;
    request.validate_token_ids(llama.config().vocab_size)?;
    let ids = llama.encode_request(request)?;
    let state = llama.request_state(ids, request)?;
    llama.with_prompt_logprobs(state, request)
}

/// The blocking baseline: one `submit` for the whole generation, so the model serves
/// this request from first to last token before any other job gets a turn.
pub fn streaming_handler<B: LlamaBackend, T: Tokenizer>(
    In(request): In<GenerateRequest>,
    model: ModelAccessor<Llama<B, T>>,
    cancel: CancelToken,
    output: OutStream<TokenOutput>,
) -> Result<()> {
    model.submit(move |llama| {
        let mut state = prepare(llama, &request)?;
        let mut sampler = constrained_sampler(llama, &request)?;
        for index in 0.. {
            if cancel.is_cancelled() {
                return Err(LlamaError::Cancelled);
            }
            let (token_id, token, done) = llama.next_token(&mut state, &mut sampler)?;
            output.emit(TokenOutput {
                token,
                token_id,
                index,
                logprobs: state.take_logprobs(),
                prompt_logprobs: state.take_prompt_logprobs(),
                cached_prompt_tokens: None,
            })?;
            if done {
                break;
            }
        }
        Ok(())
    })?
}

/// The concurrent handler: one `submit` per token. The request's state (with its own
/// KV cache) lives in this job and visits the model thread for each token, so requests
/// interleave at token boundaries and none can see another's cache. Cancelling (or
/// dropping the job's stream) stops it before its next token and frees its cache.
pub fn concurrent_streaming_handler<B: LlamaBackend, T: Tokenizer>(
    In(request): In<GenerateRequest>,
    model: ModelAccessor<Llama<B, T>>,
    cancel: CancelToken,
    output: OutStream<TokenOutput>,
) -> Result<()> {
    let request = std::sync::Arc::new(request);
    let prepared = {
        let request = request.clone();
        model.submit(move |llama| {
            let state = prepare(llama, &request)?;
            Ok::<_, LlamaError>((state, constrained_sampler(llama, &request)?))
        })??
    };
    let mut carry = Some(prepared);
    for index in 0.. {
        if cancel.is_cancelled() {
            return Err(LlamaError::Cancelled);
        }
        let (mut state, mut sampler) = carry
            .take()
            .ok_or_else(|| LlamaError::Runtime("generation state lost".into()))?;
        let (mut state, sampler, step) = model.submit(move |llama| {
            let step = llama.next_token(&mut state, &mut sampler);
            (state, sampler, step)
        })?;
        let (token_id, token, done) = step?;
        output.emit(TokenOutput {
            token,
            token_id,
            index,
            logprobs: state.take_logprobs(),
            prompt_logprobs: state.take_prompt_logprobs(),
            cached_prompt_tokens: None,
        })?;
        if done {
            break;
        }
        carry = Some((state, sampler));
    }
    Ok(())
}
