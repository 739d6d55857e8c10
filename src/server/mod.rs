//! `tern serve`: an OpenAI-compatible HTTP server for the models a user names, with the same
//! engine the CLI uses.
//!
//! Shape: the HTTP side (axum on tokio) parses and validates requests and answers errors; the
//! compute side is one thread per model, fed by a channel: an embedding worker that packs
//! waiting requests into one batch by a token budget, and a generation scheduler that admits new
//! sequences between decode steps and drops a sequence as soon as its client is gone. A request
//! beyond `--max-concurrent-requests` is refused at once with 429; malformed requests get a 4xx
//! with `{"error": {"message", "type", "code"}}`, never a 500 or a crash.

mod embeddings;
mod generation;
pub mod metrics;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value as Json};

use crate::error::{Error, Result};
use crate::runtime::embed::{Embedder, LoadOptions};
use crate::runtime::generate::Llm;
use crate::runtime::resolve::resolve_model_or_file;
use metrics::Metrics;

#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub models: Vec<String>,
    pub host: String,
    pub port: u16,
    /// Worker threads per model (0: one per core).
    pub threads: usize,
    /// Where embedding models run.
    pub device: crate::cuda::DeviceSpec,
    /// GEMM precision of embedding models on a GPU.
    pub dtype: crate::kernels::cuda_ops::Precision,
    /// Token budget of one embedding batch, across requests.
    pub max_batch_tokens: usize,
    /// Requests served at once; more are refused with 429.
    pub max_concurrent_requests: usize,
    /// Sequences decoding at once per LLM; more wait in the queue.
    pub max_sequences: usize,
    /// Largest request body.
    pub max_request_bytes: usize,
    /// Most inputs in one embedding request.
    pub max_inputs: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            models: Vec::new(),
            host: "127.0.0.1".into(),
            port: 8080,
            threads: 0,
            device: crate::cuda::DeviceSpec::Auto,
            dtype: crate::kernels::cuda_ops::Precision::F32,
            max_batch_tokens: 8192,
            max_concurrent_requests: 64,
            max_sequences: 16,
            max_request_bytes: 8 << 20,
            max_inputs: 2048,
        }
    }
}

/// An error answered to a client: status, OpenAI-style type and a short code.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", code, message: message.into() }
    }
    fn not_found(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::NOT_FOUND, kind: "not_found_error", code: "model_not_found", message: message.into() }
    }
    fn unavailable(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, kind: "server_unavailable", code, message: message.into() }
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", code: "internal_error", message: message.into() }
    }
}

/// Engine errors on a request's own input are the client's to fix (400); the rest are ours.
impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        match e {
            Error::Input(_) | Error::Tokenizer(_) => ApiError::bad_request("invalid_input", e.to_string()),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "code": self.code}});
        (self.status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }
}

pub type ApiResult<T> = std::result::Result<T, ApiError>;

enum Engine {
    Embedding(embeddings::EmbeddingModel),
    Llm(generation::LlmModel),
}

struct ServedModel {
    /// The name clients use: the `--model` argument as given.
    id: String,
    /// Also accepted: the last path component, without `.gguf`.
    alias: String,
    engine: Engine,
}

pub struct AppState {
    opts: ServeOptions,
    models: OnceLock<Vec<ServedModel>>,
    pub metrics: Metrics,
    draining: AtomicBool,
    started: u64,
}

impl AppState {
    fn find(&self, name: &str) -> ApiResult<&ServedModel> {
        let models = self.ready()?;
        models.iter().find(|m| m.id == name || m.alias == name).ok_or_else(|| {
            let known: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
            ApiError::not_found(format!("model `{name}` is not served here (served: {})", known.join(", ")))
        })
    }

    fn ready(&self) -> ApiResult<&Vec<ServedModel>> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("shutting_down", "the server is shutting down"));
        }
        self.models.get().ok_or_else(|| ApiError::unavailable("loading", "models are still loading"))
    }
}

/// Holds one of the `--max-concurrent-requests` slots while a request is served (streams
/// included) and records the answer in the metrics.
pub struct RequestSlot {
    state: Arc<AppState>,
    endpoint: &'static str,
    started: Instant,
    status: u16,
}

impl RequestSlot {
    fn acquire(state: &Arc<AppState>, endpoint: &'static str) -> ApiResult<RequestSlot> {
        let limit = state.opts.max_concurrent_requests as u64;
        let now = state.metrics.in_flight.fetch_add(1, Ordering::SeqCst);
        if now >= limit {
            state.metrics.in_flight.fetch_sub(1, Ordering::SeqCst);
            state.metrics.rejected_busy.fetch_add(1, Ordering::Relaxed);
            state.metrics.record_request(endpoint, 429, 0.0);
            return Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "rate_limit_error",
                code: "server_busy",
                message: format!("the server is serving {limit} requests (--max-concurrent-requests); retry shortly"),
            });
        }
        Ok(RequestSlot { state: state.clone(), endpoint, started: Instant::now(), status: 200 })
    }

    fn set_status(&mut self, status: StatusCode) {
        self.status = status.as_u16();
    }
}

impl Drop for RequestSlot {
    fn drop(&mut self) {
        self.state.metrics.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.state.metrics.record_request(self.endpoint, self.status, self.started.elapsed().as_secs_f64());
    }
}

/// The request body as JSON, within the size limit; each failure its own 4xx.
async fn read_json(state: &AppState, body: Body) -> ApiResult<Json> {
    let limit = state.opts.max_request_bytes;
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|_| ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        kind: "invalid_request_error",
        code: "request_too_large",
        message: format!("the request body is over the limit of {limit} bytes (--max-request-bytes)"),
    })?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|e| ApiError::bad_request("invalid_utf8", format!("the request body is not valid UTF-8 ({e})")))?;
    let v: Json = serde_json::from_str(text).map_err(|e| ApiError::bad_request("invalid_json", format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("invalid_json", "the request body must be a JSON object"));
    }
    Ok(v)
}

fn required_str<'a>(body: &'a Json, key: &str) -> ApiResult<&'a str> {
    match body.get(key) {
        Some(Json::String(s)) => Ok(s),
        Some(other) => Err(ApiError::bad_request("invalid_type", format!("`{key}` must be a string, not {}", type_name(other)))),
        None => Err(ApiError::bad_request("missing_field", format!("`{key}` is required"))),
    }
}

pub(crate) fn type_name(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn list_models(State(state): State<Arc<AppState>>) -> ApiResult<Response> {
    let models = state.ready()?;
    let data: Vec<Json> = models
        .iter()
        .map(|m| {
            let kind = match m.engine {
                Engine::Embedding(_) => "embedding",
                Engine::Llm(_) => "chat",
            };
            json!({"id": m.id, "object": "model", "created": state.started, "owned_by": "tern", "kind": kind})
        })
        .collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready() {
        Ok(models) => axum::Json(json!({"status": "ok", "models": models.len()})).into_response(),
        Err(e) => (e.status, axum::Json(json!({"status": e.code, "message": e.message}))).into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

async fn fallback() -> ApiError {
    ApiError { status: StatusCode::NOT_FOUND, kind: "not_found_error", code: "unknown_endpoint", message: "no such endpoint".into() }
}

fn load_model(spec: &str, opts: &ServeOptions, state: &Arc<AppState>) -> Result<ServedModel> {
    let path = resolve_model_or_file(spec)?;
    let alias = path
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| spec.to_string());
    let engine = if crate::runtime::generate::is_llm(&path)? {
        // A server decodes its sequences in rounds: decode attention in the blocks that suit
        // many sequences at once (the same for every sequence, alone or batched).
        crate::kernels::attention::cuda::prefer_batched_decode(opts.max_sequences > 1);
        let placement = LoadOptions { threads: opts.threads, max_tokens: None, device: opts.device, dtype: opts.dtype }.placement()?;
        let llm = Llm::load_on(&path, opts.threads, &placement)?;
        Engine::Llm(generation::LlmModel::start(llm, opts, state.clone()))
    } else {
        let e = Embedder::load(&path, &LoadOptions { threads: opts.threads, max_tokens: None, device: opts.device, dtype: opts.dtype })?;
        Engine::Embedding(embeddings::EmbeddingModel::start(e, opts, state.clone()))
    };
    Ok(ServedModel { id: spec.to_string(), alias, engine })
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/embeddings", post(embeddings::handle))
        .route("/v1/chat/completions", post(generation::chat_completions))
        .route("/v1/completions", post(generation::completions))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(fallback)
        .with_state(state)
}

/// Binds, loads the models (answering `/health` with 503 meanwhile), serves until SIGINT or
/// SIGTERM, then stops accepting, lets running requests finish and returns.
pub fn serve(opts: ServeOptions) -> Result<()> {
    if opts.models.is_empty() {
        return Err(Error::Input("give at least one --model".into()));
    }
    if opts.max_concurrent_requests == 0 || opts.max_sequences == 0 || opts.max_batch_tokens == 0 {
        return Err(Error::Input("--max-concurrent-requests, --max-sequences and --max-batch-tokens must be at least 1".into()));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Input(format!("cannot start the server runtime: {e}")))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", opts.host, opts.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| Error::io(&addr, e))?;
        let local: SocketAddr = listener.local_addr().map_err(|e| Error::io(&addr, e))?;
        let state = Arc::new(AppState {
            opts: opts.clone(),
            models: OnceLock::new(),
            metrics: Metrics::default(),
            draining: AtomicBool::new(false),
            started: unix_now(),
        });
        eprintln!("tern serve: listening on http://{local} (loading {} model(s))", opts.models.len());
        let loader_state = state.clone();
        let loader = tokio::task::spawn_blocking(move || -> Result<()> {
            let mut models = Vec::new();
            for spec in &loader_state.opts.models {
                let t = Instant::now();
                models.push(load_model(spec, &loader_state.opts, &loader_state)?);
                eprintln!("tern serve: loaded {spec} in {:.2} s", t.elapsed().as_secs_f64());
            }
            let _ = loader_state.models.set(models);
            eprintln!("tern serve: ready");
            Ok(())
        });
        let shutdown_state = state.clone();
        let (failed_tx, mut failed_rx) = tokio::sync::oneshot::channel::<Error>();
        tokio::spawn(async move {
            match loader.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let _ = failed_tx.send(e);
                }
                Err(e) => {
                    let _ = failed_tx.send(Error::Input(format!("model loading stopped: {e}")));
                }
            }
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<Option<Error>>();
        tokio::spawn(async move {
            let reason = tokio::select! {
                _ = shutdown_signal() => None,
                e = &mut failed_rx => match e {
                    Ok(e) => Some(e),
                    // Loading succeeded (the sender is gone): serve until a signal.
                    Err(_) => {
                        shutdown_signal().await;
                        None
                    }
                },
            };
            shutdown_state.draining.store(true, Ordering::Relaxed);
            if reason.is_none() {
                eprintln!("tern serve: shutting down (finishing {} request(s))", shutdown_state.metrics.in_flight.load(Ordering::Relaxed));
            }
            let _ = stop_tx.send(reason);
        });
        let (reason_tx, reason_rx) = tokio::sync::oneshot::channel::<Option<Error>>();
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                let reason = stop_rx.await.unwrap_or(None);
                let _ = reason_tx.send(reason);
            })
            .await
            .map_err(|e| Error::io(&addr, e))?;
        match reason_rx.await {
            Ok(Some(e)) => Err(e),
            _ => Ok(()),
        }
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
