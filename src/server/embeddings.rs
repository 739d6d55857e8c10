//! `POST /v1/embeddings`, and the worker that batches requests across clients.
//!
//! The worker takes every job waiting (up to the token budget), packs their sequences into
//! batches of at most `--max-batch-tokens` tokens and runs them. Each sequence attends only to
//! itself and is pooled alone, and a request's vectors come from the same row → embedding code as
//! the CLI's, so what a request gets does not depend on who it was batched with.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{json, Value as Json};
use tokio::sync::{mpsc, oneshot};

use super::{read_json, required_str, type_name, ApiError, ApiResult, AppState, Engine, RequestSlot, ServeOptions};
use crate::runtime::embed::{EmbedOptions, Embedder};

struct EmbedJob {
    ids: Vec<Vec<u32>>,
    tokens: usize,
    normalize: bool,
    out_dim: usize,
    reply: oneshot::Sender<std::result::Result<Vec<Vec<f32>>, String>>,
}

pub(super) struct EmbeddingModel {
    embedder: Arc<Embedder>,
    jobs: mpsc::Sender<EmbedJob>,
}

impl EmbeddingModel {
    pub(super) fn start(embedder: Embedder, opts: &ServeOptions, state: Arc<AppState>) -> EmbeddingModel {
        let embedder = Arc::new(embedder);
        // Never full: at most max_concurrent_requests jobs exist at once.
        let (tx, rx) = mpsc::channel(opts.max_concurrent_requests.max(1));
        let worker = embedder.clone();
        let budget = opts.max_batch_tokens;
        std::thread::Builder::new()
            .name("tern-embed".into())
            .spawn(move || run_worker(&worker, rx, budget, &state))
            .expect("spawning the embedding worker thread");
        EmbeddingModel { embedder, jobs: tx }
    }
}

fn run_worker(embedder: &Embedder, mut rx: mpsc::Receiver<EmbedJob>, budget: usize, state: &AppState) {
    let metrics = &state.metrics;
    while let Some(first) = rx.blocking_recv() {
        let mut jobs = vec![first];
        let mut tokens = jobs[0].tokens;
        while tokens < budget {
            match rx.try_recv() {
                Ok(j) => {
                    tokens += j.tokens;
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        metrics.queue_depth.fetch_sub(jobs.len() as u64, Ordering::Relaxed);
        // A client that went away while waiting costs nothing.
        jobs.retain(|j| !j.reply.is_closed());
        let mut results: Vec<std::result::Result<Vec<Vec<f32>>, String>> = jobs.iter().map(|j| Ok(Vec::with_capacity(j.ids.len()))).collect();
        for normalize in [true, false] {
            // (job, sequence) pairs of this normalisation, in arrival order.
            let seqs: Vec<(usize, &Vec<u32>)> =
                jobs.iter().enumerate().filter(|(_, j)| j.normalize == normalize).flat_map(|(i, j)| j.ids.iter().map(move |s| (i, s))).collect();
            let mut start = 0;
            while start < seqs.len() {
                let mut end = start + 1;
                let mut used = seqs[start].1.len();
                while end < seqs.len() && used + seqs[end].1.len() <= budget {
                    used += seqs[end].1.len();
                    end += 1;
                }
                let batch: Vec<Vec<u32>> = seqs[start..end].iter().map(|(_, s)| (*s).clone()).collect();
                metrics.embedding_batch_sequences.observe(batch.len() as f64);
                metrics.embedding_batch_tokens.observe(used as f64);
                metrics.embedding_tokens.fetch_add(used as u64, Ordering::Relaxed);
                let dim = embedder.dim();
                match embedder.pipeline_rows(&batch, normalize) {
                    Ok(rows) => {
                        for (row, &(job, _)) in rows.chunks(dim).zip(&seqs[start..end]) {
                            let v = embedder.finish_row(row, jobs[job].out_dim, normalize).map_err(|e| e.to_string());
                            match (&mut results[job], v) {
                                (Ok(out), Ok(v)) => out.push(v),
                                (r @ Ok(_), Err(e)) => *r = Err(e),
                                (Err(_), _) => {}
                            }
                        }
                    }
                    Err(e) => {
                        for &(job, _) in &seqs[start..end] {
                            results[job] = Err(e.to_string());
                        }
                    }
                }
                start = end;
            }
        }
        for (job, result) in jobs.into_iter().zip(results) {
            let _ = job.reply.send(result);
        }
    }
}

pub(super) async fn handle(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let mut slot = match RequestSlot::acquire(&state, "/v1/embeddings") {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    match embed(&state, body).await {
        Ok(r) => r,
        Err(e) => {
            slot.set_status(e.status);
            e.into_response()
        }
    }
}

enum Inputs {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

fn parse_inputs(v: Option<&Json>, max_inputs: usize) -> ApiResult<Inputs> {
    let bad = |m: String| ApiError::bad_request("invalid_input", m);
    let ids_of = |v: &Json, at: &str| -> ApiResult<Vec<u32>> {
        let arr = v.as_array().ok_or_else(|| bad(format!("{at} must be an array of token ids")))?;
        arr.iter()
            .enumerate()
            .map(|(j, x)| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(format!("{at}[{j}] is not a token id"))))
            .collect()
    };
    let inputs = match v {
        None => return Err(ApiError::bad_request("missing_field", "`input` is required")),
        Some(Json::String(s)) => Inputs::Texts(vec![s.clone()]),
        Some(Json::Array(items)) if items.is_empty() => return Err(bad("`input` is an empty array".into())),
        Some(Json::Array(items)) => match &items[0] {
            Json::String(_) => Inputs::Texts(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| x.as_str().map(str::to_string).ok_or_else(|| bad(format!("input[{i}] is {}, expected a string like input[0]", type_name(x)))))
                    .collect::<ApiResult<_>>()?,
            ),
            Json::Number(_) => Inputs::Ids(vec![ids_of(&Json::Array(items.clone()), "input")?]),
            Json::Array(_) => Inputs::Ids(items.iter().enumerate().map(|(i, x)| ids_of(x, &format!("input[{i}]"))).collect::<ApiResult<_>>()?),
            other => return Err(bad(format!("input[0] is {}, expected a string, a token id or an array of token ids", type_name(other)))),
        },
        Some(other) => return Err(bad(format!("`input` is {}, expected a string or an array", type_name(other)))),
    };
    let n = match &inputs {
        Inputs::Texts(t) => t.len(),
        Inputs::Ids(i) => i.len(),
    };
    if n > max_inputs {
        return Err(bad(format!("{n} inputs, over the limit of {max_inputs} per request (--max-inputs)")));
    }
    Ok(inputs)
}

fn opt_string(body: &Json, key: &str) -> ApiResult<Option<String>> {
    match body.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ApiError::bad_request("invalid_type", format!("`{key}` must be a string, not {}", type_name(other)))),
    }
}

async fn embed(state: &Arc<AppState>, body: Body) -> ApiResult<Response> {
    let body = read_json(state, body).await?;
    let name = required_str(&body, "model")?.to_string();
    let served = state.find(&name)?;
    let Engine::Embedding(model) = &served.engine else {
        return Err(ApiError::bad_request("wrong_model_kind", format!("`{name}` is a chat model; /v1/embeddings needs an embedding model")));
    };
    let inputs = parse_inputs(body.get("input"), state.opts.max_inputs)?;
    let base64 = match opt_string(&body, "encoding_format")?.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::bad_request("invalid_value", format!("encoding_format `{other}`: expected float or base64"))),
    };
    let dimensions = match body.get("dimensions") {
        None | Some(Json::Null) => None,
        Some(v) => Some(v.as_u64().filter(|&d| d > 0).ok_or_else(|| ApiError::bad_request("invalid_value", format!("`dimensions` must be a positive integer, not {v}")))? as usize),
    };
    let normalize = match body.get("normalize") {
        None | Some(Json::Null) => true,
        Some(Json::Bool(b)) => *b,
        Some(other) => return Err(ApiError::bad_request("invalid_type", format!("`normalize` must be a boolean, not {}", type_name(other)))),
    };
    let opts = EmbedOptions {
        prompt_name: opt_string(&body, "prompt_name")?,
        prompt: opt_string(&body, "prompt")?,
        dimensions,
        normalize,
        // A server does not cut silently: an over-long input is the client's to shorten.
        truncate: false,
        batch_tokens: state.opts.max_batch_tokens,
    };
    let embedder = model.embedder.clone();
    let out_dim = embedder.check_dimensions(&opts).map_err(|e| ApiError::bad_request("invalid_value", e.to_string()))?;
    let ids = tokio::task::spawn_blocking(move || -> ApiResult<Vec<Vec<u32>>> {
        let ids = match inputs {
            Inputs::Texts(texts) => {
                let refs: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
                embedder.tokenize(&refs, &opts)?.0
            }
            Inputs::Ids(ids) => ids,
        };
        let (limit, vocab) = (embedder.tokenizer.max_tokens(), embedder.pipeline.cfg().vocab_size);
        for (i, s) in ids.iter().enumerate() {
            if s.is_empty() {
                return Err(ApiError::bad_request("invalid_input", format!("input[{i}] has no tokens")));
            }
            if s.len() > limit {
                return Err(ApiError::bad_request("input_too_long", format!("input[{i}] has {} tokens, over the model's limit of {limit}", s.len())));
            }
            if let Some(&id) = s.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::bad_request("invalid_input", format!("input[{i}] holds token id {id}, outside the vocabulary of {vocab}")));
            }
        }
        Ok(ids)
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??;
    let tokens: usize = ids.iter().map(|s| s.len()).sum();
    let (reply, answer) = oneshot::channel();
    state.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if model.jobs.send(EmbedJob { ids, tokens, normalize, out_dim, reply }).await.is_err() {
        state.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::internal("the embedding worker has stopped"));
    }
    let vectors = answer.await.map_err(|_| ApiError::internal("the embedding worker dropped the request"))?.map_err(ApiError::internal)?;
    let data: Vec<EmbeddingData> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                EmbeddingValue::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                EmbeddingValue::Float(v)
            };
            EmbeddingData { object: "embedding", index, embedding }
        })
        .collect();
    // Serialized straight from f32, so each value prints in its shortest f32 form.
    let body = EmbeddingResponse { object: "list", data, model: name, usage: json!({"prompt_tokens": tokens, "total_tokens": tokens}) };
    let text = serde_json::to_string(&body).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(([(axum::http::header::CONTENT_TYPE, "application/json")], text).into_response())
}

#[derive(serde::Serialize)]
struct EmbeddingResponse {
    object: &'static str,
    data: Vec<EmbeddingData>,
    model: String,
    usage: Json,
}

#[derive(serde::Serialize)]
struct EmbeddingData {
    object: &'static str,
    index: usize,
    embedding: EmbeddingValue,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum EmbeddingValue {
    Float(Vec<f32>),
    Base64(String),
}
