//! Errors as HTTP responses in OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::LlamaError;

/// An error answer: its status, the OpenAI error object, and for 429 a `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// Seconds after which a refused request may be retried (sent as `Retry-After`).
    pub retry_after: Option<u64>,
}

/// The JSON body of an error.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorBody<'a> {
    /// The error object.
    pub error: ErrorObject<'a>,
}

/// OpenAI's error object.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorObject<'a> {
    /// Human-readable message.
    pub message: &'a str,
    /// Error type.
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// The request field at fault.
    pub param: Option<&'a str>,
    /// Machine-readable code.
    pub code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: a field has an invalid value (or the body is not valid JSON).
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            param: param.map(str::to_string),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                message.into(),
            )
        }
    }

    /// 403: a route this server does not open.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or incorrect API key: send `Authorization: Bearer <key>`",
            )
        }
    }

    /// 404 for something the request names that does not exist (for this tenant).
    pub fn not_found(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            param: param.map(Into::into),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }

    /// 404: the model is not the one served.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{asked}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// 404 for an unknown route.
    pub fn route_not_found(path: &str) -> Self {
        Self {
            code: Some("not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("no route for {path}"),
            )
        }
    }

    /// 413: the body is over the size limit.
    pub fn too_large(limit: usize) -> Self {
        Self {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than the limit of {limit} bytes"),
            )
        }
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        Self {
            code: Some("request_timeout"),
            ..Self::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s (limit: --body-timeout)",
                    limit.as_secs_f64()
                ),
            )
        }
    }

    /// 503: the server is loading its model or shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            code: Some("service_unavailable"),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    /// 500: something failed inside the server.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The OpenAI error body of this error, as JSON.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!(ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
    }

    /// Maps an engine error to its HTTP answer; `prompt_param` names the field the
    /// prompt came from (`messages` or `prompt`).
    pub fn from_llama(error: &LlamaError, prompt_param: &str) -> Self {
        match error {
            LlamaError::InvalidParameter { name, .. } => {
                Self::invalid(error.to_string(), Some(name))
            }
            LlamaError::PromptTooLong { .. } => Self {
                code: Some("context_length_exceeded"),
                ..Self::invalid(error.to_string(), Some(prompt_param))
            },
            LlamaError::EmptyPrompt | LlamaError::Tokenizer(_) | LlamaError::InvalidBatch(_) => {
                Self::invalid(error.to_string(), Some(prompt_param))
            }
            LlamaError::InvalidConstraint(_) => Self {
                code: Some("invalid_constraint"),
                ..Self::invalid(error.to_string(), Some("response_format"))
            },
            LlamaError::Overloaded { .. } => Self {
                code: Some("queue_full"),
                retry_after: Some(1),
                ..Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    error.to_string(),
                )
            },
            LlamaError::Cancelled | LlamaError::ModelUnavailable(_) => {
                Self::unavailable(error.to_string())
            }
            LlamaError::UnknownAdapter(_) => Self {
                param: Some("model".into()),
                code: Some("model_not_found"),
                ..Self::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    error.to_string(),
                )
            },
            LlamaError::InvalidAdapter { .. }
            | LlamaError::Io { .. }
            | LlamaError::InvalidFormat(_)
            | LlamaError::Truncated(_)
            | LlamaError::UnsupportedTensorType { .. }
            | LlamaError::MissingTensor(_) => Self::invalid(error.to_string(), Some(prompt_param)),
            other => Self::internal(other.to_string()),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_engine_errors_to_statuses() {
        let too_long = LlamaError::PromptTooLong {
            tokens: 3000,
            max: 2047,
        };
        let e = ApiError::from_llama(&too_long, "messages");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("3000") && e.message.contains("2047"));
        assert_eq!(e.param.as_deref(), Some("messages"));
        let overloaded = LlamaError::Overloaded {
            resource: "waiting requests",
            in_use: 4,
            requested: 1,
            limit: 4,
        };
        let e = ApiError::from_llama(&overloaded, "prompt");
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after, Some(1));
        let e = ApiError::from_llama(&LlamaError::invalid("top_p", 2, "bad"), "prompt");
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(
            ApiError::from_llama(&LlamaError::Runtime("x".into()), "prompt").status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn body_has_openai_shape() {
        let body = ApiError::model_not_found("gpt-4", "smol").body();
        let error = &body["error"];
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(error["param"], "model");
        assert_eq!(error["code"], "model_not_found");
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| m.contains("gpt-4"))
        );
    }
}
