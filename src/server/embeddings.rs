//! `POST /v1/embeddings`: one vector per input, made by the engine between its
//! generation steps ([`ContinuousEngine::embed_to`](crate::inference::ContinuousEngine::embed_to)),
//! the same bits as [`Llama::embed_ids`](crate::Llama::embed_ids) whatever else runs.
//!
//! The request passes the body's limits (size, depth, repeated keys, `--max-prompts`
//! inputs) before it is read, and the tenant's share before any input is tokenized;
//! texts are tokenized on the tokenizer pool, never on the engine thread.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Json, Response};
use base64::Engine as _;

use super::error::ApiError;
use super::limits::{check_depth, check_input_count, check_unique_keys};
use super::openai::{EmbeddingRequest, EncodingFormat, PromptInput};
use super::responses::{EmbeddingList, EmbeddingObject, EmbeddingUsage, EmbeddingVector};
use super::routes::{
    ClientRequestId, Extras, Tenant, TenantOf, check_model, keyed_tenant, read_body, read_extras,
};
use super::{ServerConfig, Shared};
use crate::embed::EmbeddingOptions;
use crate::error::LlamaError;
use crate::inference::CancelToken;

/// Cancels the engine's work when the handler is dropped (the client went away).
struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// One embedding per input, as OpenAI's `embeddings.create` asks.
#[utoipa::path(post, path = "/v1/embeddings", tag = "embeddings",
    request_body(content = super::openapi::EmbeddingBody, content_type = "application/json"),
    responses(
        (status = 200, description = "The vectors", body = EmbeddingList),
        super::routes::GenerationErrors,
    ),
    security((), ("bearer" = [])),
)]
pub(super) async fn embeddings(
    State(shared): State<Arc<Shared>>,
    Extension(ClientRequestId(request_id)): Extension<ClientRequestId>,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(&shared, body).await?;
    let (request, extras, model) = read_embedding(&shared.config, &body)?;
    drop(body);
    let engine = shared.engine()?;
    if let Some(name) = model {
        if engine.has_adapter(&name) {
            return Err(ApiError::invalid(
                format!("`{name}` is a LoRA adapter; embeddings are made by the served model"),
                Some("model"),
            ));
        }
        return Err(ApiError::model_not_found(
            &name,
            &shared.config.served_model_name,
        ));
    }
    let width = engine.embedding_width();
    let dimensions = match request.dimensions {
        None => None,
        Some(n) if (1..=width as u64).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(
                format!("`dimensions` = {n} is outside [1, {width}], the model's width"),
                Some("dimensions"),
            ));
        }
    };
    let options = EmbeddingOptions {
        pooling: shared.config.embedding_pooling,
        normalize: true,
        dimensions,
    };
    let format = request.encoding_format.unwrap_or_default();
    let inputs = request.inputs()?;
    // The tenant's share first: a request over it costs nothing more.
    let tenant = TenantOf::new(tenant, extras);
    let _slot = shared.reserve(&tenant.name, 1, tenant.capped)?;
    shared
        .metrics
        .tenant_request(&tenant.name, keyed_tenant(&shared, &tenant.name));
    let ids = token_ids(&shared, &tenant, inputs).await?;
    let prompt_tokens = ids.iter().map(Vec::len).sum();

    let cancel = CancelToken::new();
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    let (tx, rx) = tokio::sync::oneshot::channel();
    engine
        .embed_to(
            ids,
            options,
            cancel,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        )
        .map_err(|e| ApiError::from_llama(&e, "input"))?;
    let vectors = rx
        .await
        .map_err(|_| {
            ApiError::from_llama(
                &LlamaError::ModelUnavailable("the engine has stopped".into()),
                "input",
            )
        })?
        .map_err(|e| ApiError::from_llama(&e, "input"))?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, vector)| EmbeddingObject {
            object: "embedding",
            index,
            embedding: encode(vector, format),
        })
        .collect();
    let answer = EmbeddingList {
        object: "list",
        data,
        model: shared.config.served_model_name.clone(),
        usage: EmbeddingUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    };
    let mut response = Json(answer).into_response();
    if let Some(value) = request_id.and_then(|id| HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert("x-request-id", value);
    }
    Ok(response)
}

/// Every check an embedding body passes before any work is done and without the
/// engine: the body's depth, repeated keys and count of inputs, the parse, `user`, and
/// the model name (`Some`: not the served model's; the handler asks the engine whether
/// it is an adapter's).
pub(super) fn read_embedding(
    config: &ServerConfig,
    body: &[u8],
) -> Result<(EmbeddingRequest, Extras, Option<String>), ApiError> {
    check_depth(body, config.max_json_depth)?;
    check_unique_keys(body)?;
    check_input_count(body, config)?;
    let request = EmbeddingRequest::parse(body)?;
    let extras = read_extras(body)?;
    let model = check_model(config, request.model.as_deref())?;
    Ok((request, extras, model))
}

/// Every input's token ids: texts tokenized on the tokenizer pool (in the tenant's
/// share of it), ids as sent (the engine checks them before queueing).
async fn token_ids(
    shared: &Arc<Shared>,
    tenant: &TenantOf,
    inputs: Vec<PromptInput>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let texts: Vec<String> = inputs
        .iter()
        .filter_map(|input| match input {
            PromptInput::Text(text) => Some(text.clone()),
            _ => None,
        })
        .collect();
    let mut encoded = if texts.is_empty() {
        Vec::new()
    } else {
        let _tokenizing = shared.enter_tokenizer(&tenant.name, tenant.capped)?;
        shared
            .tokenizer
            .encode_texts(shared.engine()?, texts)
            .await
            .map_err(|e| ApiError::from_llama(&e, "input"))?
    }
    .into_iter();
    inputs
        .into_iter()
        .map(|input| match input {
            PromptInput::Ids(ids) => Ok(ids),
            _ => encoded
                .next()
                .ok_or_else(|| ApiError::internal("an input's tokens went missing")),
        })
        .collect()
}

/// A vector as `format` asks: numbers, or its little-endian f32 bytes in base64.
fn encode(vector: Vec<f32>, format: EncodingFormat) -> EmbeddingVector {
    match format {
        EncodingFormat::Float => EmbeddingVector::Float(vector),
        EncodingFormat::Base64 => {
            let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
            EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_little_endian_bytes() {
        let v = vec![1.0f32, -2.5, 0.0];
        let EmbeddingVector::Base64(text) = encode(v.clone(), EncodingFormat::Base64) else {
            panic!("not base64");
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .expect("valid base64");
        let back: Vec<f32> = bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(back, v);
        assert!(matches!(
            encode(v, EncodingFormat::Float),
            EmbeddingVector::Float(f) if f == [1.0, -2.5, 0.0]
        ));
    }
}
