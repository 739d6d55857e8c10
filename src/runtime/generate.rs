//! Text generation with a Qwen3.5 model: load once ([`Llm`]), keep one [`Session`] per
//! conversation (its recurrent state and KV cache), and run [`Llm::generate`], which prefills
//! the new tokens, then samples and feeds one token at a time, streaming text that never splits
//! a UTF-8 character, until an end-of-turn token, a stop string, the token limit or the context
//! end. [`ChatSession`] adds the chat template and feeds each turn's new tokens only.
//!
//! A session's last sampled token is kept pending rather than run at once: a generation that
//! ends needs no forward pass for a token whose logits nobody reads, and the next call runs it
//! first, so the conversation's state stays complete.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value as Json};

use crate::error::{Error, Result};
use crate::formats::config::JsonFile;
use crate::formats::gguf::GgufFile;
use crate::models::qwen35::{PlacedQwen35, PlacedState};
use crate::kernels::sample::{LogitsWant, StepLogits};
use crate::models::Placement;
use crate::runtime::chat_template::ChatTemplate;
use crate::runtime::sampler::{Sampler, SamplingOptions};
use crate::runtime::tokenizer::Tokenizer;

/// A loaded LLM: weights, tokenizer, chat template, end-of-turn ids, sampling defaults.
pub struct Llm {
    pub model: PlacedQwen35,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Tokens that end a generation (EOS and end-of-turn).
    pub stop_ids: Vec<u32>,
    /// The model's recommended sampling (`generation_config.json`), else llama.cpp's defaults.
    pub default_sampling: SamplingOptions,
    pub path: PathBuf,
    token_bytes: Vec<Vec<u8>>,
    pool: rayon::ThreadPool,
}

const _: () = {
    const fn assert_sync<T: Send + Sync>() {}
    assert_sync::<Llm>();
};

/// Per-conversation state.
pub struct Session {
    state: PlacedState,
    /// Every token of the conversation, the pending one included.
    ids: Vec<u32>,
    /// Sampled last and not yet run through the model.
    pending: Option<u32>,
}

impl Session {
    /// Every token of the conversation so far (prompt and generated, the pending one included).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Tokens the model has run (the pending token excluded).
    pub fn processed(&self) -> usize {
        self.state.position()
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingOptions,
    /// Generation ends before the first occurrence of any of these in the text.
    pub stop: Vec<String>,
    /// Keep the logits that chose each token ([n_generated, vocab]).
    pub keep_logits: bool,
    /// Go on past end-of-turn tokens (not written to the text) until `max_tokens`, the
    /// context's end or a stop string: what a benchmark of a fixed generation length asks
    /// (vLLM's and llama.cpp's servers take the same `ignore_eos`).
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-turn token or a stop string.
    Stop,
    /// The token limit or the end of the model's context.
    Length,
    /// The caller's callback asked to stop (a client that went away).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prefill_s: f64,
    pub generated_tokens: usize,
    pub decode_s: f64,
}

impl Timings {
    pub fn to_json(&self) -> Json {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        // Decode steps: every generated token but the first needed a forward pass of its own.
        let steps = self.generated_tokens.saturating_sub(1);
        json!({
            "prompt_tokens": self.prompt_tokens,
            "prefill_s": self.prefill_s,
            "prefill_tokens_per_s": rate(self.prompt_tokens, self.prefill_s),
            "generated_tokens": self.generated_tokens,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": rate(steps, self.decode_s),
        })
    }
}

pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    /// The generated text, end-of-turn token and anything from a stop string on left out.
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: Timings,
    /// Row t holds the logits that produced generated token t (when asked for).
    pub logits: Vec<f32>,
}

impl Llm {
    /// A Hugging Face checkpoint directory (`qwen3_5_text`, `qwen3_5_moe_text` or a wrapper) or a
    /// llama.cpp GGUF file (`qwen35`, `qwen35moe`) with its embedded tokenizer.
    pub fn load(path: &Path, threads: usize) -> Result<Llm> {
        Self::load_on(path, threads, &Placement::Cpu)
    }

    /// [`Llm::load`] with the weights on `placement` (`threads` serve the CPU's work).
    pub fn load_on(path: &Path, threads: usize, placement: &Placement) -> Result<Llm> {
        let (model, tokenizer, template, mut stop_ids, default_sampling) = if path.is_file() {
            // One parse of the header (a 248k-entry vocabulary) serves the weights and tokenizer.
            let f = GgufFile::open(path)?;
            let model = PlacedQwen35::from_gguf(&f, placement)?;
            let tokenizer = Tokenizer::from_gguf(&f)?;
            let mut stops: Vec<u32> = Vec::new();
            for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
                stops.extend(f.opt_u32(key)?);
            }
            // llama.cpp also ends a turn at these control tokens when the vocabulary has them.
            let special = tokenizer.special_tokens();
            stops.extend(["<|im_end|>", "<|endoftext|>"].iter().filter_map(|t| special.get(*t).copied()));
            (model, tokenizer, ChatTemplate::from_gguf(&f)?, stops, SamplingOptions::default())
        } else {
            let model = PlacedQwen35::load(path, placement)?;
            let tokenizer = Tokenizer::load_file(path)?;
            let (stops, sampling) = generation_config(path)?;
            (model, tokenizer, ChatTemplate::from_dir(path)?, stops, sampling)
        };
        stop_ids.extend(&model.cfg().eos_ids);
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let token_bytes = tokenizer.token_bytes(model.cfg().vocab_size);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Input(format!("cannot start {threads} threads: {e}")))?;
        Ok(Llm { model, tokenizer, template, stop_ids, default_sampling, path: path.to_path_buf(), token_bytes, pool })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    pub fn context_length(&self) -> usize {
        self.model.cfg().max_positions
    }

    pub fn vocab_size(&self) -> usize {
        self.model.cfg().vocab_size
    }

    /// A fresh conversation (its state allocated on the model's device).
    pub fn new_session(&self) -> Result<Session> {
        Ok(Session { state: self.model.new_state()?, ids: Vec::new(), pending: None })
    }

    /// Token ids of a prompt given as text (no special tokens added; written ones are matched).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode_text(text)
    }

    /// The bytes of a token (empty for ids the tokenizer does not know).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], |b| b.as_slice())
    }

    /// Checks ids against the vocabulary and the context before anything runs.
    pub fn check_prompt(&self, session: &Session, ids: &[u32]) -> Result<()> {
        self.check_tokens(&session.ids, ids)
    }

    /// As [`Llm::check_prompt`], for a conversation that has seen `before`.
    pub fn check_tokens(&self, before: &[u32], ids: &[u32]) -> Result<()> {
        if ids.is_empty() && before.is_empty() {
            return Err(Error::Input("the prompt is empty".into()));
        }
        let vocab = self.vocab_size();
        if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::Input(format!("prompt token {i} is id {id}, outside the vocabulary of {vocab}")));
        }
        let total = before.len() + ids.len();
        if total >= self.context_length() {
            return Err(Error::Input(format!(
                "the prompt needs {total} tokens{}, but the model's context holds {} (and one more for the first generated token)",
                if before.is_empty() { String::new() } else { format!(" with the {} of the conversation so far", before.len()) },
                self.context_length() - 1
            )));
        }
        Ok(())
    }

    /// Continues `session` with `ids` and generates. `on_text` receives the text as it becomes
    /// final (whole characters, nothing that could still turn into a stop string) and returns
    /// false to cancel.
    pub fn generate(
        &self,
        session: &mut Session,
        ids: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let mut g = self.start(session, ids, opts)?;
        loop {
            let step = g.step(session)?;
            if !step.text.is_empty() && !on_text(&step.text) {
                return Ok(g.cancel());
            }
            if step.finished {
                return Ok(g.finish());
            }
        }
    }

    /// Runs `ids` after what `session` has seen (the prefill) and returns the generation, to be
    /// advanced one token at a time with [`Generator::step`], so that a scheduler can interleave
    /// several sequences and drop one at any step.
    pub fn start(&self, session: &mut Session, ids: &[u32], opts: &GenerateOptions) -> Result<Generator<'_>> {
        self.check_prompt(session, ids)?;
        let sampler = Sampler::new(opts.sampling.clone())?;
        let mut feed: Vec<u32> = session.pending.take().into_iter().collect();
        feed.extend_from_slice(ids);
        session.ids.extend_from_slice(ids);
        let t0 = Instant::now();
        let want = logits_want(opts, &sampler);
        let logits = self.pool.install(|| self.model.forward_want(&feed, &mut session.state, want))?;
        let timings = Timings { prompt_tokens: feed.len(), prefill_s: t0.elapsed().as_secs_f64(), ..Default::default() };
        Ok(Generator {
            llm: self,
            opts: opts.clone(),
            sampler,
            stream: TextStream::new(&opts.stop),
            logits: Some(logits),
            out: Generation {
                prompt_ids: ids.to_vec(),
                generated_ids: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                timings,
                logits: Vec::new(),
            },
            finished: opts.max_tokens == 0,
        })
    }
}

impl Llm {
    /// One step of several generations at once: the pending tokens of those that need a forward
    /// pass run through the model together (one read of the weights for all), then each samples
    /// its next token. Results are in the order given; a failed pass fails every sequence in it.
    pub fn step_many(&self, items: &mut [(&mut Generator<'_>, &mut Session)]) -> Vec<Result<Step>> {
        let need: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, (g, s))| !g.finished && g.logits.is_none() && s.pending.is_some())
            .map(|(i, _)| i)
            .collect();
        let mut failed: Option<String> = None;
        if !need.is_empty() {
            let t = Instant::now();
            let tokens: Vec<[u32; 1]> = need.iter().map(|&i| [items[i].1.pending.unwrap_or_default()]).collect();
            let wants: Vec<LogitsWant> = need.iter().map(|&i| items[i].0.want()).collect();
            let mut batch: Vec<(&[u32], &mut PlacedState)> = items
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| need.contains(i))
                .zip(&tokens)
                .map(|((_, (_, s)), tok)| (tok.as_slice(), &mut s.state))
                .collect();
            match self.pool.install(|| self.model.forward_batch_wants(&mut batch, &wants)) {
                Ok(logits) => {
                    drop(batch);
                    let secs = t.elapsed().as_secs_f64();
                    for (&i, l) in need.iter().zip(logits) {
                        let (g, s) = &mut items[i];
                        s.pending = None;
                        g.logits = Some(l);
                        g.out.timings.decode_s += secs;
                    }
                }
                Err(e) => failed = Some(e.to_string()),
            }
        }
        items
            .iter_mut()
            .enumerate()
            .map(|(i, (g, s))| match &failed {
                Some(msg) if need.contains(&i) => Err(Error::Input(msg.clone())),
                _ => g.step(s),
            })
            .collect()
    }
}

/// What a generation reads of a step's logits: the whole row when it keeps them, else what its
/// sampler needs.
fn logits_want(opts: &GenerateOptions, sampler: &Sampler) -> LogitsWant {
    if opts.keep_logits {
        LogitsWant::Full
    } else {
        sampler.wants()
    }
}

/// One sequence's generation in progress (see [`Llm::start`]).
pub struct Generator<'m> {
    llm: &'m Llm,
    opts: GenerateOptions,
    sampler: Sampler,
    stream: TextStream,
    /// The logits for the next token, when already computed (after the prefill).
    logits: Option<StepLogits>,
    out: Generation,
    finished: bool,
}

/// What one step produced: text that became final, and whether the generation is over.
pub struct Step {
    pub text: String,
    pub finished: bool,
}

impl Generator<'_> {
    /// What this generation reads of a step's logits ([`logits_want`]).
    fn want(&self) -> LogitsWant {
        logits_want(&self.opts, &self.sampler)
    }

    /// Runs the pending token (except right after the prefill), samples the next one and
    /// reports the text that became final. After the last step, `finished` is set and the text
    /// held back for stop strings is flushed.
    pub fn step(&mut self, session: &mut Session) -> Result<Step> {
        if self.finished {
            return Ok(Step { text: self.stream.finish(), finished: true });
        }
        let t = Instant::now();
        let logits = match self.logits.take() {
            Some(l) => l,
            None => {
                let Some(token) = session.pending.take() else {
                    return Err(Error::Input("generation step without a pending token".into()));
                };
                let (llm, want) = (self.llm, self.want());
                llm.pool.install(|| llm.model.forward_want(&[token], &mut session.state, want))?
            }
        };
        if self.opts.keep_logits {
            match &logits {
                StepLogits::Full(row) => self.out.logits.extend_from_slice(row),
                StepLogits::Best(_) => return Err(Error::Input("kept logits were not computed in full".into())),
            }
        }
        let token = self.sampler.sample_step(logits, &session.ids, &self.out.generated_ids);
        self.out.generated_ids.push(token);
        session.ids.push(token);
        session.pending = Some(token);
        let mut text = String::new();
        let end_of_turn = self.llm.stop_ids.contains(&token);
        if end_of_turn && !self.opts.ignore_eos {
            self.out.finish_reason = FinishReason::Stop;
            self.finished = true;
        } else {
            let (emit, stopped) = if end_of_turn { (String::new(), false) } else { self.stream.push(self.llm.token_bytes(token)) };
            text = emit;
            if stopped {
                self.out.finish_reason = FinishReason::Stop;
                self.finished = true;
            } else if self.out.generated_ids.len() >= self.opts.max_tokens || session.ids.len() >= self.llm.context_length() {
                self.out.finish_reason = FinishReason::Length;
                self.finished = true;
            }
        }
        if self.finished {
            text.push_str(&self.stream.finish());
        }
        self.out.timings.decode_s += t.elapsed().as_secs_f64();
        Ok(Step { text, finished: self.finished })
    }

    pub fn generated(&self) -> &[u32] {
        &self.out.generated_ids
    }

    /// The generation so far, ended by the caller.
    pub fn cancel(mut self) -> Generation {
        self.out.finish_reason = FinishReason::Cancelled;
        self.finish()
    }

    pub fn finish(mut self) -> Generation {
        self.out.text = std::mem::take(&mut self.stream.text);
        self.out.timings.generated_tokens = self.out.generated_ids.len();
        self.out
    }
}

/// Whether a resolved model path is an LLM: a GGUF file, or a directory whose config.json is a
/// Qwen3.5 checkpoint (other directories are embedding models).
pub fn is_llm(path: &Path) -> Result<bool> {
    if path.is_file() {
        return Ok(true);
    }
    let cfg = JsonFile::read(&path.join("config.json"))?;
    Ok(cfg.opt_str("model_type")?.is_some_and(|t| t.starts_with("qwen3_5")))
}

/// Stop ids and sampling defaults from `generation_config.json` (absent: the config's EOS only,
/// llama.cpp's sampling defaults; `do_sample: false` means greedy).
fn generation_config(dir: &Path) -> Result<(Vec<u32>, SamplingOptions)> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok((Vec::new(), SamplingOptions::default()));
    }
    let cfg = JsonFile::read(&path)?;
    let stops = match cfg.get("eos_token_id") {
        Some(Json::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Json::Array(a)) => a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
        _ => Vec::new(),
    };
    let mut s = SamplingOptions::default();
    if cfg.opt_bool("do_sample")? == Some(false) {
        return Ok((stops, SamplingOptions::greedy()));
    }
    if let Some(t) = cfg.opt_f64("temperature")? {
        s.temperature = t as f32;
    }
    if let Some(k) = cfg.opt_usize("top_k")? {
        s.top_k = k;
    }
    if let Some(p) = cfg.opt_f64("top_p")? {
        s.top_p = p as f32;
    }
    if let Some(p) = cfg.opt_f64("min_p")? {
        s.min_p = p as f32;
    }
    if let Some(r) = cfg.opt_f64("repetition_penalty")? {
        s.repeat_penalty = r as f32;
    }
    Ok((stops, s))
}

/// Turns token bytes into text as it becomes final: a character split across tokens waits for
/// its last byte, and text that might be the start of a stop string waits until it is not.
pub struct TextStream {
    stops: Vec<String>,
    /// Bytes of an unfinished UTF-8 character.
    partial: Vec<u8>,
    /// All text so far (cut at a stop string once one is found).
    pub text: String,
    /// How much of `text` has been handed out.
    emitted: usize,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        TextStream { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), partial: Vec::new(), text: String::new(), emitted: 0 }
    }

    /// Adds a token's bytes; returns the text that became final and whether a stop string ended
    /// the text.
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        self.partial.extend_from_slice(bytes);
        let before = self.text.len();
        loop {
            match std::str::from_utf8(&self.partial) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.partial.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Valid by construction: from_utf8 vouched for the first `valid` bytes.
                    self.text.push_str(std::str::from_utf8(&self.partial[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Bytes that can never be a character: one replacement, as a lossy decode gives.
                        Some(n) => {
                            self.text.push(char::REPLACEMENT_CHARACTER);
                            self.partial.drain(..valid + n);
                        }
                        // An unfinished character at the end: wait for more bytes.
                        None => {
                            self.partial.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        // A stop string may straddle the old end: search from where it could begin.
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = before.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min();
        if let Some(at) = found {
            self.text.truncate(at);
            self.partial.clear();
            return (self.take(self.text.len()), true);
        }
        // Hold back the longest tail that is a prefix of a stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (end, _) in s.char_indices().skip(1).chain(std::iter::once((s.len(), ' '))) {
                let prefix = &s[..end];
                if end < s.len() && self.text.ends_with(prefix) {
                    hold = hold.max(prefix.len());
                }
            }
        }
        let upto = (self.text.len() - hold).max(self.emitted);
        (self.take(upto), false)
    }

    /// The held-back text, with an unfinished character replaced as a lossy decode does.
    pub fn finish(&mut self) -> String {
        if !self.partial.is_empty() {
            self.text.push(char::REPLACEMENT_CHARACTER);
            self.partial.clear();
        }
        self.take(self.text.len())
    }

    fn take(&mut self, upto: usize) -> String {
        let s = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        s
    }
}

/// A conversation through the model's chat template. Each turn renders the whole conversation
/// but runs only what is new: the text after the previous turns' rendering, plus whatever closes
/// the last assistant turn that generation did not produce (the template's end-of-turn text).
pub struct ChatSession<'m> {
    llm: &'m Llm,
    template: &'m ChatTemplate,
    pub session: Session,
    pub messages: Vec<Json>,
    /// Extra template variables (`enable_thinking`, …).
    pub variables: serde_json::Map<String, Json>,
    /// Whether the last generation ended with an end-of-turn token.
    closed_turn: bool,
}

/// Stands in for assistant content to find the text a template puts after it.
const CONTENT_MARK: &str = "\u{E000}tern-content\u{E000}";

impl<'m> ChatSession<'m> {
    pub fn new(llm: &'m Llm) -> Result<ChatSession<'m>> {
        let template = llm.template.as_ref().ok_or_else(|| {
            Error::Input(format!("{}: the model has no chat template (tokenizer_config.json `chat_template` or GGUF `tokenizer.chat_template`)", llm.path.display()))
        })?;
        Ok(ChatSession { llm, template, session: llm.new_session()?, messages: Vec::new(), variables: serde_json::Map::new(), closed_turn: false })
    }

    pub fn push_system(&mut self, text: &str) {
        self.messages.push(json!({"role": "system", "content": text}));
    }

    /// The token ids that take the conversation from what the model has seen to the prompt for
    /// the assistant's answer to `user`.
    pub fn turn_ids(&mut self, user: &str) -> Result<Vec<u32>> {
        let render = |m: &[Json], gen: bool| self.template.render(m, gen, &self.variables);
        let past = if self.session.ids.is_empty() { None } else { Some(render(&self.messages, false)?) };
        self.messages.push(json!({"role": "user", "content": user}));
        let full = render(&self.messages, true)?;
        let text = match past {
            None => full,
            Some(past) => {
                // What the template writes after an assistant message's content; generation
                // produced its first token already when it ended at an end-of-turn token.
                let mut marked = self.messages[..self.messages.len() - 1].to_vec();
                if let Some(last) = marked.last_mut() {
                    last["content"] = Json::String(CONTENT_MARK.into());
                }
                let closing = render(&marked, false)?;
                let mut glue = closing.split_once(CONTENT_MARK).map_or(String::new(), |(_, after)| after.to_string());
                if self.closed_turn {
                    let mut end = String::new();
                    if let Some(&id) = self.session.ids.last() {
                        end = String::from_utf8_lossy(self.llm.token_bytes(id)).into_owned();
                    }
                    glue = glue.strip_prefix(end.as_str()).map(str::to_string).unwrap_or_default();
                }
                let common = common_prefix_len(&past, &full);
                glue + &full[common..]
            }
        };
        self.llm.tokenize(&text)
    }

    /// One user turn: runs the new tokens, generates the answer, records it.
    pub fn send(&mut self, user: &str, opts: &GenerateOptions, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Generation> {
        let before = self.messages.len();
        let ids = match self.turn_ids(user) {
            Ok(ids) => ids,
            Err(e) => {
                self.messages.truncate(before);
                return Err(e);
            }
        };
        let g = match self.llm.generate(&mut self.session, &ids, opts, on_text) {
            Ok(g) => g,
            Err(e) => {
                self.messages.truncate(before);
                return Err(e);
            }
        };
        self.closed_turn = g.finish_reason == FinishReason::Stop
            && g.generated_ids.last().is_some_and(|id| self.llm.stop_ids.contains(id));
        self.messages.push(json!({"role": "assistant", "content": g.text}));
        Ok(g)
    }
}

fn common_prefix_len(a: &str, b: &str) -> usize {
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            return i;
        }
        n = i + ca.len_utf8();
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = TextStream::new(&stops);
        let mut out = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let (e, st) = s.push(p);
            out.push(e);
            if st {
                stopped = true;
                break;
            }
        }
        out.push(s.finish());
        (out, s.text.clone(), stopped)
    }

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let e = "é😀".as_bytes();
        let (out, text, _) = run(&[], &[b"a", &e[..1], &e[1..3], &e[3..5], &e[5..]]);
        assert_eq!(out, vec!["a", "", "é", "", "😀", ""]);
        assert_eq!(text, "aé😀");
        // An unfinished character at the end and an impossible byte become replacements.
        let (_, text, _) = run(&[], &[b"x\xff", &e[..1]]);
        assert_eq!(text, "x\u{FFFD}\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_cut_and_never_streamed() {
        let (out, text, stopped) = run(&["</s>"], &[b"ab<", b"/", b"s>cd"]);
        assert!(stopped);
        assert_eq!(text, "ab");
        assert_eq!(out.concat(), "ab");
        assert_eq!(out[0], "ab");
        // A false start is released once it cannot be a stop string.
        let (out, text, stopped) = run(&["</s>"], &[b"a<", b"/x"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a", "</x", ""]);
        assert_eq!(text, "a</x");
    }

    #[test]
    fn common_prefix_respects_characters() {
        assert_eq!(common_prefix_len("aéb", "aéc"), 3);
        assert_eq!(common_prefix_len("é", "è"), 0);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
    }
}
