//! `POST /v1/chat/completions` and `POST /v1/completions`, and the scheduler that runs an LLM's
//! sequences.
//!
//! Continuous batching: the scheduler advances every active sequence by one token per round, all
//! of them in one forward pass over the weights (`Llm::step_many`), and admits waiting requests
//! between rounds (up to `--max-sequences` at once), so a new request starts at the next round
//! instead of after the running ones. A sequence whose client has gone (its event channel
//! closed) is dropped before the next round, freeing its state at once.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value as Json};
use tokio::sync::mpsc;

use super::{read_json, required_str, type_name, unix_now, ApiError, ApiResult, AppState, Engine, RequestSlot, ServeOptions};
use crate::runtime::generate::{FinishReason, GenerateOptions, Generator, Llm, Session};
use crate::runtime::sampler::SamplingOptions;

enum GenEvent {
    Text(String),
    Done { finish: FinishReason, prompt_tokens: usize, completion_tokens: usize },
    Failed(String),
}

struct GenJob {
    ids: Vec<u32>,
    opts: GenerateOptions,
    events: mpsc::UnboundedSender<GenEvent>,
}

pub(super) struct LlmModel {
    llm: Arc<Llm>,
    jobs: std::sync::mpsc::Sender<GenJob>,
}

impl LlmModel {
    pub(super) fn start(llm: Llm, opts: &ServeOptions, state: Arc<AppState>) -> LlmModel {
        let llm = Arc::new(llm);
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = llm.clone();
        let max = opts.max_sequences;
        std::thread::Builder::new()
            .name("tern-generate".into())
            .spawn(move || run_scheduler(&worker, rx, max, &state))
            .expect("spawning the generation scheduler thread");
        LlmModel { llm, jobs: tx }
    }
}

struct Active<'m> {
    generator: Generator<'m>,
    session: Session,
    events: mpsc::UnboundedSender<GenEvent>,
    prompt_tokens: usize,
}

fn run_scheduler(llm: &Llm, rx: std::sync::mpsc::Receiver<GenJob>, max_sequences: usize, state: &AppState) {
    let m = &state.metrics;
    let mut waiting: VecDeque<GenJob> = VecDeque::new();
    let mut active: Vec<Active<'_>> = Vec::new();
    loop {
        if active.is_empty() && waiting.is_empty() {
            match rx.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        while let Ok(job) = rx.try_recv() {
            waiting.push_back(job);
        }
        while active.len() < max_sequences {
            let Some(job) = waiting.pop_front() else { break };
            m.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                continue;
            }
            let started = llm.new_session().and_then(|mut session| Ok((llm.start(&mut session, &job.ids, &job.opts)?, session)));
            match started {
                Ok((generator, session)) => {
                    m.prompt_tokens.fetch_add(job.ids.len() as u64, Ordering::Relaxed);
                    active.push(Active { generator, session, events: job.events, prompt_tokens: job.ids.len() });
                }
                Err(e) => {
                    let _ = job.events.send(GenEvent::Failed(e.to_string()));
                }
            }
        }
        // A client that went away frees its sequence before the round.
        active.retain(|a| !a.events.is_closed());
        if active.is_empty() {
            continue;
        }
        m.decode_batch_sequences.observe(active.len() as f64);
        let round = Instant::now();
        let results = {
            let mut items: Vec<_> = active.iter_mut().map(|a| (&mut a.generator, &mut a.session)).collect();
            llm.step_many(&mut items)
        };
        let mut produced = 0u64;
        // Per sequence: None to go on, Some(true) finished, Some(false) failed (already told).
        let mut ended: Vec<Option<bool>> = Vec::with_capacity(active.len());
        for (a, result) in active.iter_mut().zip(results) {
            match result {
                Ok(step) => {
                    produced += 1;
                    if !step.text.is_empty() {
                        let _ = a.events.send(GenEvent::Text(step.text));
                    }
                    ended.push(step.finished.then_some(true));
                }
                Err(e) => {
                    let _ = a.events.send(GenEvent::Failed(e.to_string()));
                    ended.push(Some(false));
                }
            }
        }
        // Highest index first, so swap_remove only moves sequences already looked at.
        for (idx, end) in ended.into_iter().enumerate().rev() {
            let Some(finished) = end else { continue };
            let a = active.swap_remove(idx);
            if finished {
                let g = a.generator.finish();
                let _ = a.events.send(GenEvent::Done {
                    finish: g.finish_reason,
                    prompt_tokens: a.prompt_tokens,
                    completion_tokens: g.generated_ids.len(),
                });
            }
        }
        m.completion_tokens.fetch_add(produced, Ordering::Relaxed);
        let s = round.elapsed().as_secs_f64();
        if s > 0.0 {
            m.decode_tokens_per_s_milli.store((produced as f64 / s * 1000.0) as u64, Ordering::Relaxed);
        }
    }
}

/// The request's sampling, over the model's defaults.
fn generate_options(body: &Json, llm: &Llm, prompt_len: usize) -> ApiResult<GenerateOptions> {
    let bad = |m: String| ApiError::bad_request("invalid_value", m);
    let num = |key: &str| -> ApiResult<Option<f64>> {
        match body.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(ApiError::bad_request("invalid_type", format!("`{key}` must be a number, not {}", type_name(other)))),
        }
    };
    let int = |key: &str| -> ApiResult<Option<i64>> {
        match body.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Number(n)) => n.as_i64().map(Some).ok_or_else(|| bad(format!("`{key}` must be an integer, not {n}"))),
            Some(other) => Err(ApiError::bad_request("invalid_type", format!("`{key}` must be an integer, not {}", type_name(other)))),
        }
    };
    if let Some(n) = int("n")? {
        if n != 1 {
            return Err(bad(format!("n = {n}: this server returns one choice per request")));
        }
    }
    let d = &llm.default_sampling;
    let top_k = match int("top_k")? {
        None => d.top_k,
        // -1 is "off" for vLLM and llama.cpp clients.
        Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => return Err(bad(format!("top_k {k} must be >= 0 (or -1 for no limit)"))),
    };
    let seed = match int("seed")? {
        Some(s) => s as u64,
        None => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos() as u64) ^ next_id(),
    };
    let sampling = SamplingOptions {
        temperature: num("temperature")?.map_or(d.temperature, |v| v as f32),
        top_k,
        top_p: num("top_p")?.map_or(d.top_p, |v| v as f32),
        min_p: num("min_p")?.map_or(d.min_p, |v| v as f32),
        repeat_penalty: num("repetition_penalty")?.map_or(d.repeat_penalty, |v| v as f32),
        presence_penalty: num("presence_penalty")?.map_or(0.0, |v| v as f32),
        frequency_penalty: num("frequency_penalty")?.map_or(0.0, |v| v as f32),
        seed,
    };
    sampling.validate().map_err(|e| bad(e.to_string()))?;
    let room = llm.context_length().saturating_sub(prompt_len);
    let max_tokens = match int("max_completion_tokens")?.or(int("max_tokens")?) {
        None => room,
        Some(n) if n >= 1 => n as usize,
        Some(n) => return Err(bad(format!("max_tokens {n} must be at least 1"))),
    };
    let stop = match body.get("stop") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| ApiError::bad_request("invalid_type", "`stop` must be a string or an array of strings")))
            .collect::<ApiResult<_>>()?,
        Some(other) => return Err(ApiError::bad_request("invalid_type", format!("`stop` must be a string or an array of strings, not {}", type_name(other)))),
    };
    if stop.len() > 16 {
        return Err(bad(format!("{} stop strings: at most 16", stop.len())));
    }
    Ok(GenerateOptions { max_tokens, sampling, stop, keep_logits: false, ignore_eos: flag(body, "ignore_eos")? })
}

fn flag(body: &Json, key: &str) -> ApiResult<bool> {
    match body.get(key) {
        None | Some(Json::Null) => Ok(false),
        Some(Json::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::bad_request("invalid_type", format!("`{key}` must be a boolean, not {}", type_name(other)))),
    }
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[derive(Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Completion,
}

pub(super) async fn chat_completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    serve_generation(state, body, Api::Chat).await
}

pub(super) async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    serve_generation(state, body, Api::Completion).await
}

async fn serve_generation(state: Arc<AppState>, body: Body, api: Api) -> Response {
    let endpoint = if api == Api::Chat { "/v1/chat/completions" } else { "/v1/completions" };
    let mut slot = match RequestSlot::acquire(&state, endpoint) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    match generation(&state, body, api, &mut slot).await {
        Ok(Reply::Whole(r)) => r,
        Ok(Reply::Stream(rx, ctx)) => stream_response(rx, ctx, slot),
        Err(e) => {
            slot.set_status(e.status);
            e.into_response()
        }
    }
}

enum Reply {
    Whole(Response),
    Stream(mpsc::UnboundedReceiver<GenEvent>, StreamContext),
}

struct StreamContext {
    api: Api,
    id: String,
    model: String,
    include_usage: bool,
}

/// The prompt's token ids: the chat template over `messages`, or `prompt` as text or ids.
fn prompt_ids(body: &Json, llm: &Llm, api: Api) -> ApiResult<Vec<u32>> {
    match api {
        Api::Chat => {
            let messages = match body.get("messages") {
                Some(Json::Array(m)) if !m.is_empty() => m,
                Some(Json::Array(_)) => return Err(ApiError::bad_request("invalid_input", "`messages` is empty")),
                Some(other) => return Err(ApiError::bad_request("invalid_type", format!("`messages` must be an array, not {}", type_name(other)))),
                None => return Err(ApiError::bad_request("missing_field", "`messages` is required")),
            };
            for (i, m) in messages.iter().enumerate() {
                if !m.get("role").is_some_and(|r| r.is_string()) {
                    return Err(ApiError::bad_request("invalid_input", format!("messages[{i}] needs a string `role`")));
                }
                match m.get("content") {
                    None | Some(Json::Null) | Some(Json::String(_)) | Some(Json::Array(_)) => {}
                    Some(other) => return Err(ApiError::bad_request("invalid_type", format!("messages[{i}].content must be a string or an array of parts, not {}", type_name(other)))),
                }
            }
            let template = llm
                .template
                .as_ref()
                .ok_or_else(|| ApiError::bad_request("no_chat_template", "this model has no chat template; use /v1/completions"))?;
            let mut vars = serde_json::Map::new();
            if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
                vars.insert("tools".into(), tools.clone());
            }
            match body.get("chat_template_kwargs") {
                None | Some(Json::Null) => {}
                Some(Json::Object(kw)) => vars.extend(kw.clone()),
                Some(other) => return Err(ApiError::bad_request("invalid_type", format!("`chat_template_kwargs` must be an object, not {}", type_name(other)))),
            }
            let messages = with_parsed_tool_arguments(messages);
            let text = template.render(&messages, true, &vars).map_err(|e| ApiError::bad_request("invalid_input", e.to_string()))?;
            Ok(llm.tokenize(&text)?)
        }
        Api::Completion => {
            let bad = |m: String| ApiError::bad_request("invalid_input", m);
            let as_ids = |a: &[Json]| -> ApiResult<Vec<u32>> {
                a.iter()
                    .enumerate()
                    .map(|(i, x)| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(format!("prompt[{i}] is not a token id"))))
                    .collect()
            };
            match body.get("prompt") {
                Some(Json::String(s)) => Ok(llm.tokenize(s)?),
                Some(Json::Array(a)) if a.len() == 1 && a[0].is_string() => Ok(llm.tokenize(a[0].as_str().unwrap_or_default())?),
                Some(Json::Array(a)) if a.len() == 1 && a[0].is_array() => as_ids(a[0].as_array().map_or(&[][..], |v| v.as_slice())),
                Some(Json::Array(a)) if !a.is_empty() && a[0].is_number() => as_ids(a),
                Some(Json::Array(a)) if a.len() > 1 => Err(bad("one prompt per request".into())),
                Some(Json::Array(_)) => Err(bad("`prompt` is empty".into())),
                Some(other) => Err(ApiError::bad_request("invalid_type", format!("`prompt` must be a string or token ids, not {}", type_name(other)))),
                None => Err(ApiError::bad_request("missing_field", "`prompt` is required")),
            }
        }
    }
}

/// OpenAI clients send a tool call's `arguments` as a JSON string; chat templates iterate over
/// them as a mapping (transformers passes dicts), so a string holding a JSON object is parsed.
fn with_parsed_tool_arguments(messages: &[Json]) -> Vec<Json> {
    let mut out = messages.to_vec();
    for m in &mut out {
        let Some(Json::Array(calls)) = m.get_mut("tool_calls") else { continue };
        for call in calls {
            let Some(f) = call.get_mut("function") else { continue };
            if let Some(Json::String(args)) = f.get("arguments") {
                if let Ok(obj @ Json::Object(_)) = serde_json::from_str::<Json>(args) {
                    f["arguments"] = obj;
                }
            }
        }
    }
    out
}

async fn generation(state: &Arc<AppState>, body: Body, api: Api, slot: &mut RequestSlot) -> ApiResult<Reply> {
    let body = read_json(state, body).await?;
    let name = required_str(&body, "model")?.to_string();
    let served = state.find(&name)?;
    let Engine::Llm(model) = &served.engine else {
        return Err(ApiError::bad_request("wrong_model_kind", format!("`{name}` is an embedding model; use /v1/embeddings")));
    };
    let stream = flag(&body, "stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Json::Null) => false,
        Some(o @ Json::Object(_)) => flag(o, "include_usage")?,
        Some(other) => return Err(ApiError::bad_request("invalid_type", format!("`stream_options` must be an object, not {}", type_name(other)))),
    };
    let llm = model.llm.clone();
    let body_for_prompt = body.clone();
    let ids = tokio::task::spawn_blocking(move || prompt_ids(&body_for_prompt, &llm, api))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??;
    model.llm.check_tokens(&[], &ids)?;
    let opts = generate_options(&body, &model.llm, ids.len())?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    state.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    if model.jobs.send(GenJob { ids, opts, events: tx }).is_err() {
        state.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::internal("the generation scheduler has stopped"));
    }
    let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
    let id = format!("{prefix}-{:x}{:06x}", unix_now(), next_id());
    if stream {
        return Ok(Reply::Stream(rx, StreamContext { api, id, model: name, include_usage }));
    }
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(GenEvent::Text(t)) => text.push_str(&t),
            Some(GenEvent::Done { finish, prompt_tokens, completion_tokens }) => {
                let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                let choice = match api {
                    Api::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish.as_str(), "logprobs": null}),
                    Api::Completion => json!({"index": 0, "text": text, "finish_reason": finish.as_str(), "logprobs": null}),
                };
                let object = if api == Api::Chat { "chat.completion" } else { "text_completion" };
                return Ok(Reply::Whole(
                    axum::Json(json!({"id": id, "object": object, "created": unix_now(), "model": name, "choices": [choice], "usage": usage})).into_response(),
                ));
            }
            Some(GenEvent::Failed(msg)) => {
                slot.set_status(axum::http::StatusCode::BAD_REQUEST);
                return Err(ApiError::bad_request("generation_failed", msg));
            }
            None => return Err(ApiError::internal("the generation scheduler dropped the request")),
        }
    }
}

/// Server-sent events: one chunk per piece of text, a final chunk with the finish reason, the
/// usage chunk when asked for, then `data: [DONE]`.
fn stream_response(mut rx: mpsc::UnboundedReceiver<GenEvent>, ctx: StreamContext, slot: RequestSlot) -> Response {
    let (tx, out) = mpsc::channel::<std::result::Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        // Held until the stream ends, so the request counts against the limit while it streams.
        let _slot = slot;
        let created = unix_now();
        let object = if ctx.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |choice: Json, usage: Option<Json>| {
            let mut c = json!({"id": ctx.id, "object": object, "created": created, "model": ctx.model, "choices": [choice]});
            if ctx.include_usage {
                c["usage"] = usage.unwrap_or(Json::Null);
            }
            Event::default().data(c.to_string())
        };
        let piece = |text: &str, finish: Option<&str>| match ctx.api {
            Api::Chat => json!({"index": 0, "delta": if finish.is_some() { json!({}) } else { json!({"content": text}) }, "finish_reason": finish, "logprobs": null}),
            Api::Completion => json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null}),
        };
        if ctx.api == Api::Chat {
            let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null});
            if tx.send(Ok(chunk(first, None))).await.is_err() {
                return;
            }
        }
        while let Some(ev) = rx.recv().await {
            let events = match ev {
                GenEvent::Text(t) => vec![chunk(piece(&t, None), None)],
                GenEvent::Done { finish, prompt_tokens, completion_tokens } => {
                    let mut v = vec![chunk(piece("", Some(finish.as_str())), None)];
                    if ctx.include_usage {
                        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                        let mut c = json!({"id": ctx.id, "object": object, "created": created, "model": ctx.model, "choices": []});
                        c["usage"] = usage;
                        v.push(Event::default().data(c.to_string()));
                    }
                    v.push(Event::default().data("[DONE]"));
                    v
                }
                GenEvent::Failed(msg) => vec![
                    Event::default().data(json!({"error": {"message": msg, "type": "invalid_request_error", "code": "generation_failed"}}).to_string()),
                    Event::default().data("[DONE]"),
                ],
            };
            for e in events {
                if tx.send(Ok(e)).await.is_err() {
                    // The client left: dropping `rx` tells the scheduler to free the sequence.
                    return;
                }
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out)).keep_alive(KeepAlive::default()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_arguments_given_as_json_strings_become_objects() {
        let messages = vec![
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}},
                {"type": "function", "function": {"name": "g", "arguments": "not json"}},
            ]}),
            json!({"role": "user", "content": "x"}),
        ];
        let out = with_parsed_tool_arguments(&messages);
        assert_eq!(out[0]["tool_calls"][0]["function"]["arguments"], json!({"city": "Oslo", "days": 2}));
        assert_eq!(out[0]["tool_calls"][1]["function"]["arguments"], json!("not json"));
        assert_eq!(out[1], messages[1]);
    }
}
