//! `tern`: the command-line front end.

use std::io::{BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tern::error::{Error, Result};
use tern::formats::npy;
use tern::runtime::embed::{EmbedOptions, Embedder, Embeddings, LoadOptions};
use tern::runtime::generate::{ChatSession, GenerateOptions, Llm};
use tern::runtime::resolve::{resolve_model, resolve_model_or_file};
use tern::runtime::sampler::{Sampler, SamplingOptions};
use tern::cuda::DeviceSpec;
use tern::kernels::cuda_ops::Precision;
use tern::kernels::sample::LogitsWant;

#[derive(Parser)]
#[command(name = "tern", version, about = "Embeddings (EmbeddingGemma) and Qwen3.5 generation, on CPU and NVIDIA GPUs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Turn texts into embedding vectors.
    Embed(EmbedArgs),
    /// Measure throughput and latency.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Generate text with a Qwen3.5 model (HF directory or GGUF file).
    Generate(GenerateArgs),
    /// Talk with a Qwen3.5 model through its chat template, one line per turn.
    Chat(ChatArgs),
    /// Serve embedding and chat models over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Describe a model: architecture, sizes, prompts or chat template, limits.
    Inspect {
        /// Model directory, .gguf file, or hub id (org/name) in the local Hugging Face cache.
        #[arg(long)]
        model: String,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Format {
    Jsonl,
    Npy,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// Model directory or hub id (org/name) in the local Hugging Face cache.
    #[arg(long)]
    model: String,
    /// Where to run: auto, cpu, cuda or cuda:N (auto picks a GPU when one is usable).
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// GEMM precision on a GPU: f32 (the reference maths) or bf16 (tensor cores, f32
    /// accumulation and activations). fp16 is refused.
    #[arg(long, default_value = "f32")]
    dtype: Precision,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Lower the model's token limit.
    #[arg(long)]
    max_tokens: Option<usize>,
}

#[derive(Args)]
struct EmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prepend the prompt of this name from config_sentence_transformers.json (query, document, STS, …).
    #[arg(long, conflicts_with = "prompt")]
    prompt_name: Option<String>,
    /// Prepend this literal prompt.
    #[arg(long)]
    prompt: Option<String>,
    /// Matryoshka: keep the first N dimensions, then re-normalise.
    #[arg(long)]
    dimensions: Option<usize>,
    /// Return the pipeline's output without L2 normalisation.
    #[arg(long)]
    no_normalize: bool,
    /// Token budget of one packed batch.
    #[arg(long, default_value_t = 8192)]
    batch_tokens: usize,
    /// Refuse over-long inputs instead of truncating them.
    #[arg(long)]
    no_truncate: bool,
    /// Read inputs from FILE, one text per line (`-` for standard input).
    #[arg(long, conflicts_with = "texts")]
    input: Option<PathBuf>,
    /// Output format: jsonl (one {"index", "embedding"} object per line) or npy (float32 [n, dim]).
    #[arg(long, value_enum, default_value = "jsonl")]
    format: Format,
    /// Write to FILE instead of standard output.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Texts to embed.
    texts: Vec<String>,
}

#[derive(Args)]
struct LlmArgs {
    /// Model: a Hugging Face directory, a .gguf file, or a hub id in the local cache.
    #[arg(long)]
    model: String,
    /// Where to run: auto, cpu, cuda or cuda:N (auto picks a GPU when one is usable).
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// Matmul precision on a GPU: f32 (the reference maths) or bf16 (tensor cores, f32
    /// accumulation, activations and state). fp16 is refused.
    #[arg(long, default_value = "f32")]
    dtype: Precision,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

#[derive(Args)]
struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy (default: the model's generation_config.json, else 0.8).
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep the K most likely tokens; 0 keeps all (default: the model's, else 40).
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling threshold (default: the model's, else 0.95).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens below P times the best one's probability (default: the model's, else 0.05).
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalise tokens already in the sequence (1 is off).
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Seed for sampling (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// End the generation before this text (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Go on past end-of-turn tokens until --max-tokens (a fixed length, for timing).
    #[arg(long)]
    ignore_eos: bool,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: LlmArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// The prompt as text (no template applied unless --chat-template).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// The prompt as token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<String>>,
    /// Wrap --prompt as one user message in the model's chat template.
    #[arg(long, requires = "prompt")]
    chat_template: bool,
    /// Print one JSON object: prompt_ids, generated_ids, text, finish_reason, timings.
    #[arg(long)]
    json: bool,
    /// Write the logits that chose each generated token, float32 [n_generated, vocab].
    #[arg(long)]
    logits_out: Option<PathBuf>,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: LlmArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message to begin the conversation with.
    #[arg(long)]
    system: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    /// A model to serve (repeatable): a directory, a .gguf file or a hub id; clients name it by
    /// this string or by its last path component.
    #[arg(long = "model", required = true)]
    models: Vec<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (printed on standard error).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Worker threads per model (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where models run: auto, cpu, cuda or cuda:N (auto picks a GPU when one is usable).
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// GEMM precision of embedding models on a GPU: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: Precision,
    /// Token budget of one embedding batch, across requests.
    #[arg(long, default_value_t = 8192)]
    max_batch_tokens: usize,
    /// Requests served at once; more get 429.
    #[arg(long, default_value_t = 64)]
    max_concurrent_requests: usize,
    /// Sequences decoding together per LLM; more wait their turn.
    #[arg(long, default_value_t = 16)]
    max_sequences: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    max_request_bytes: usize,
    /// Most inputs in one embedding request.
    #[arg(long, default_value_t = 2048)]
    max_inputs: usize,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Embedding throughput (batches of documents) and single-query latency.
    Embed(BenchEmbedArgs),
    /// Qwen3.5 prefill and decode tokens/s on the CPU, read against measured rooflines.
    Generate(BenchGenerateArgs),
}

#[derive(Args)]
struct BenchGenerateArgs {
    /// A Qwen3.5 GGUF file or Hugging Face checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt length of the prefill measurement (random token ids from a fixed seed).
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens of the decode measurement (from a fresh state, as llama-bench's tg test).
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed repetitions of each measurement (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Where to run: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: DeviceSpec,
    /// Matmul precision on a GPU: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: Precision,
    /// Also time decode rounds of this many sequences at once, comma-separated (each
    /// sequence after a 16-token prompt).
    #[arg(long, value_delimiter = ',')]
    concurrent: Vec<usize>,
    /// Also time prefills of these prompt lengths, comma-separated (short prompts, a chat
    /// turn's, take other kernels than a long one's).
    #[arg(long, value_delimiter = ',')]
    prefill_also: Vec<usize>,
    /// Also time decode steps after prompts of these lengths, comma-separated: the context a
    /// reply decodes over, which the attention layers read at every step (llama-bench's `-d`,
    /// its "tg @ dN").
    #[arg(long, value_delimiter = ',')]
    decode_depth: Vec<usize>,
    /// Copy every step's whole logits row to the host and take the greedy token there (what a
    /// sampler with penalties or a request that keeps its logits costs), instead of asking the
    /// step for its best entry as a greedy generation does.
    #[arg(long)]
    full_logits: bool,
}

#[derive(Args)]
struct BenchEmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Documents per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Approximate tokens per document.
    #[arg(long, default_value_t = 128)]
    doc_tokens: usize,
    /// Timed repetitions of each measurement (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Documents to use, one per line (default: generated text).
    #[arg(long)]
    input: Option<PathBuf>,
    /// With --dtype bf16 on a GPU: also load the model in f32 mode and report the smallest
    /// cosine between the two modes' embeddings of the benchmark documents.
    #[arg(long)]
    compare_f32: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Embed(args) => run_embed(args),
        Command::Bench(BenchCommand::Generate(args)) => run_bench_generate(args),
        Command::Bench(BenchCommand::Embed(args)) => run_bench_embed(args),
        Command::Generate(args) => run_generate(args),
        Command::Chat(args) => run_chat(args),
        Command::Serve(a) => tern::server::serve(tern::server::ServeOptions {
            models: a.models,
            host: a.host,
            port: a.port,
            threads: a.threads,
            device: a.device,
            dtype: a.dtype,
            max_batch_tokens: a.max_batch_tokens,
            max_concurrent_requests: a.max_concurrent_requests,
            max_sequences: a.max_sequences,
            max_request_bytes: a.max_request_bytes,
            max_inputs: a.max_inputs,
        }),
        Command::Inspect { model } => run_inspect(&model),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load_embedder(args: &ModelArgs) -> Result<Embedder> {
    let dir = resolve_model(&args.model)?;
    Embedder::load(
        &dir,
        &LoadOptions { threads: args.threads, max_tokens: args.max_tokens, device: args.device, dtype: args.dtype },
    )
}

/// One text per line; a final newline ends the last line rather than adding an empty input.
/// Invalid UTF-8 is an error naming the line.
fn read_lines(path: &Path) -> Result<Vec<String>> {
    let mut bytes = Vec::new();
    if path == Path::new("-") {
        std::io::stdin().read_to_end(&mut bytes).map_err(|e| Error::io("<stdin>", e))?;
    } else {
        bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    }
    let name = if path == Path::new("-") { "<stdin>".into() } else { path.display().to_string() };
    let mut body = &bytes[..];
    if body.last() == Some(&b'\n') {
        body = &body[..body.len() - 1];
    }
    if body.is_empty() {
        return Ok(Vec::new());
    }
    body.split(|&b| b == b'\n')
        .enumerate()
        .map(|(i, line)| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            String::from_utf8(line.to_vec())
                .map_err(|e| Error::Input(format!("{name}: line {} is not valid UTF-8 ({e})", i + 1)))
        })
        .collect()
}

fn run_embed(args: EmbedArgs) -> Result<()> {
    let texts = match &args.input {
        Some(path) => read_lines(path)?,
        None => args.texts.clone(),
    };
    if texts.is_empty() {
        return Err(Error::Input("no inputs: give texts as arguments or --input FILE (one per line)".into()));
    }
    if args.format == Format::Npy && args.output.is_none() && std::io::stdout().is_terminal() {
        return Err(Error::Input("--format npy writes binary: give --output FILE or redirect standard output".into()));
    }
    let model = load_embedder(&args.model)?;
    let opts = EmbedOptions {
        prompt_name: args.prompt_name.clone(),
        prompt: args.prompt.clone(),
        dimensions: args.dimensions,
        normalize: !args.no_normalize,
        truncate: !args.no_truncate,
        batch_tokens: args.batch_tokens,
    };
    let refs: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
    let bar = (std::io::stderr().is_terminal() && texts.len() > 64).then(|| {
        let bar = indicatif::ProgressBar::new(texts.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} texts, {per_sec}, eta {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let out = model.embed_with_progress(&refs, &opts, |done| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    for (i, n) in &out.truncated {
        eprintln!(
            "warning: input {i} has {n} tokens; truncated to the model's limit of {}",
            model.tokenizer.max_tokens()
        );
    }
    let sink: Box<dyn Write> = match &args.output {
        Some(p) => Box::new(std::fs::File::create(p).map_err(|e| Error::io(p, e))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let name = args.output.as_ref().map_or("<stdout>".into(), |p| p.display().to_string());
    write_embeddings(BufWriter::new(sink), &out, args.format).map_err(|e| Error::io(name, e))
}

fn write_embeddings(mut w: impl Write, out: &Embeddings, format: Format) -> std::io::Result<()> {
    match format {
        Format::Npy => npy::write_f32(&mut w, &[out.len(), out.dim], &out.data)?,
        Format::Jsonl => {
            for i in 0..out.len() {
                // f32 values print in their shortest round-trip form.
                let row = serde_json::to_string(out.row(i)).map_err(std::io::Error::other)?;
                writeln!(w, "{{\"index\": {i}, \"embedding\": {row}}}")?;
            }
        }
    }
    w.flush()
}

fn load_llm(args: &LlmArgs) -> Result<Llm> {
    let path = resolve_model_or_file(&args.model)?;
    let placement = LoadOptions { threads: args.threads, max_tokens: None, device: args.device, dtype: args.dtype }.placement()?;
    Llm::load_on(&path, args.threads, &placement)
}

/// The sampling flags over the model's defaults; --seed absent means a new seed each run.
fn sampling_options(llm: &Llm, a: &SamplingArgs) -> GenerateOptions {
    let d = &llm.default_sampling;
    let clock_seed = || {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos() as u64)
    };
    let sampling = SamplingOptions {
        temperature: a.temperature.unwrap_or(d.temperature),
        top_k: a.top_k.unwrap_or(d.top_k),
        top_p: a.top_p.unwrap_or(d.top_p),
        min_p: a.min_p.unwrap_or(d.min_p),
        repeat_penalty: a.repeat_penalty.unwrap_or(d.repeat_penalty),
        seed: a.seed.unwrap_or_else(clock_seed),
        ..d.clone()
    };
    GenerateOptions { max_tokens: a.max_tokens, sampling, stop: a.stop.clone(), keep_logits: false, ignore_eos: a.ignore_eos }
}

fn parse_ids(items: &[String]) -> Result<Vec<u32>> {
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.trim().parse::<u32>().map_err(|_| Error::Input(format!("--prompt-ids: item {i} `{s}` is not a token id")))
        })
        .collect()
}

/// Writes streamed text to standard output as it comes; a closed pipe cancels the generation.
fn stdout_sink() -> impl FnMut(&str) -> bool {
    let mut out = std::io::stdout();
    move |text: &str| out.write_all(text.as_bytes()).and_then(|_| out.flush()).is_ok()
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let llm = load_llm(&args.model)?;
    let mut opts = sampling_options(&llm, &args.sampling);
    opts.keep_logits = args.logits_out.is_some();
    let ids = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => parse_ids(ids)?,
        (Some(text), None) if args.chat_template => {
            let mut chat = ChatSession::new(&llm)?;
            chat.turn_ids(text)?
        }
        (Some(text), None) => llm.tokenize(text)?,
        (None, None) => return Err(Error::Input("give --prompt TEXT or --prompt-ids 1,2,3".into())),
    };
    let mut session = llm.new_session()?;
    let g = if args.json {
        llm.generate(&mut session, &ids, &opts, &mut |_| true)?
    } else {
        let g = llm.generate(&mut session, &ids, &opts, &mut stdout_sink())?;
        println!();
        g
    };
    if let Some(path) = &args.logits_out {
        let rows = g.generated_ids.len();
        let mut w = BufWriter::new(std::fs::File::create(path).map_err(|e| Error::io(path, e))?);
        npy::write_f32(&mut w, &[rows, llm.vocab_size()], &g.logits)
            .and_then(|_| w.flush())
            .map_err(|e| Error::io(path, e))?;
    }
    if args.json {
        let out = serde_json::json!({
            "prompt_ids": g.prompt_ids,
            "generated_ids": g.generated_ids,
            "text": g.text,
            "finish_reason": g.finish_reason.as_str(),
            "timings": g.timings.to_json(),
        });
        println!("{out}");
    } else {
        let t = g.timings.to_json();
        eprintln!(
            "[{} prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, {}]",
            g.timings.prompt_tokens,
            t["prefill_tokens_per_s"].as_f64().unwrap_or(0.0),
            g.timings.generated_tokens,
            t["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            g.finish_reason.as_str()
        );
    }
    Ok(())
}

fn run_chat(args: ChatArgs) -> Result<()> {
    let llm = load_llm(&args.model)?;
    let opts = sampling_options(&llm, &args.sampling);
    let mut chat = ChatSession::new(&llm)?;
    if let Some(s) = &args.system {
        chat.push_system(s);
    }
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("chatting with {} (one line per turn; /reset starts over, /exit or end of input quits)", llm.path.display());
    }
    let mut line = String::new();
    loop {
        if interactive {
            eprint!("> ");
        }
        line.clear();
        if std::io::stdin().read_line(&mut line).map_err(|e| Error::io("<stdin>", e))? == 0 {
            break;
        }
        let text = line.trim_end_matches(['\n', '\r']);
        match text.trim() {
            "/exit" | "/quit" => break,
            "/reset" => {
                chat = ChatSession::new(&llm)?;
                if let Some(s) = &args.system {
                    chat.push_system(s);
                }
                continue;
            }
            "" => continue,
            _ => {}
        }
        let g = chat.send(text, &opts, &mut stdout_sink())?;
        println!();
        if interactive {
            eprintln!("[{} new prompt tokens, {} generated, {}]", g.timings.prompt_tokens, g.timings.generated_tokens, g.finish_reason.as_str());
        }
    }
    Ok(())
}

fn run_inspect(spec: &str) -> Result<()> {
    let path = resolve_model_or_file(spec)?;
    if tern::runtime::generate::is_llm(&path)? {
        return inspect_llm(&path);
    }
    let dir = resolve_model(spec)?;
    let model = Embedder::load(&dir, &LoadOptions::default())?;
    let p = &model.pipeline;
    let c = p.cfg();
    let info = serde_json::json!({
        "path": dir.display().to_string(),
        "architecture": format!("{:?}", c.variant),
        "layers": c.layers.len(),
        "full_attention_layers": c.layers.iter().filter(|l| l.kind == tern::models::egemma::LayerKind::Full).count(),
        "hidden_size": c.hidden,
        "query_heads": c.q_heads,
        "sliding_window_radius": c.window_max_distance(),
        "vocab_size": c.vocab_size,
        "dense_modules": p.dense_dims.len(),
        "normalize": p.normalize,
        "dim": model.dim(),
        "max_tokens": model.tokenizer.max_tokens(),
        "prompts": p.prompts,
        "weight_bytes": p.param_count() * 4,
    });
    println!("{}", serde_json::to_string_pretty(&info).unwrap_or_default());
    Ok(())
}

fn inspect_llm(path: &Path) -> Result<()> {
    let llm = Llm::load(path, 1)?;
    let c = llm.model.cfg();
    let mut info = serde_json::json!({
        "path": path.display().to_string(),
        "architecture": if c.moe.is_some() { "qwen3.5 mixture of experts" } else { "qwen3.5 dense" },
        "layers": c.n_layers,
        "full_attention_layers": (0..c.n_layers).filter(|&i| c.is_full_attention(i)).count(),
        "hidden_size": c.hidden,
        "attention": {"query_heads": c.q_heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim, "rotary_dim": c.rotary_dim, "rope_theta": c.rope_theta},
        "gated_delta": {"key_heads": c.lin_k_heads, "value_heads": c.lin_v_heads, "key_dim": c.lin_k_dim, "value_dim": c.lin_v_dim, "conv_kernel": c.conv_kernel},
        "vocab_size": c.vocab_size,
        "context_length": c.max_positions,
        "tied_embeddings": c.tie_embeddings,
        "stop_token_ids": llm.stop_ids,
        "chat_template": llm.template.is_some(),
        "default_sampling": llm.default_sampling,
    });
    if let Some(m) = &c.moe {
        info["experts"] = serde_json::json!({"count": m.experts, "top_k": m.top_k, "expert_intermediate": m.expert_intermediate, "shared_intermediate": m.shared_intermediate});
    } else {
        info["intermediate_size"] = c.intermediate.into();
    }
    if path.is_file() {
        let f = tern::formats::gguf::GgufFile::open(path)?;
        let mut types = std::collections::BTreeMap::<String, usize>::new();
        for t in f.tensors() {
            *types.entry(t.ggml_type().to_string()).or_default() += 1;
        }
        info["gguf_tensor_types"] = serde_json::json!(types);
    }
    println!("{}", serde_json::to_string_pretty(&info).unwrap_or_default());
    Ok(())
}

/// Resident and peak resident memory of this process, in bytes (Linux; 0 elsewhere).
fn memory_usage() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// FLOP/s of the CPU matrix product on a [4096 × 768] · [768 × 1152] projection.
fn model_gemm_rate(threads: usize) -> f64 {
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(threads).build() else { return f64::NAN };
    pool.install(|| tern::kernels::matmul::measure_rate(4096, 1152, 768, 5)).unwrap_or(f64::NAN)
}

/// Deterministic English-like documents of about `tokens` tokens each.
fn generated_documents(n: usize, tokens: usize) -> Vec<String> {
    const WORDS: &[&str] = &[
        "the", "tern", "is", "a", "seabird", "that", "migrates", "between", "polar", "regions", "every", "year",
        "covering", "more", "distance", "than", "any", "other", "animal", "researchers", "track", "flights",
        "with", "small", "geolocators", "data", "shows", "routes", "over", "oceans", "and", "coasts", "feeding",
        "on", "fish", "near", "surface", "colonies", "nest", "in", "summer", "light",
    ];
    let mut state = 0x9e3779b97f4a7c15u64;
    (0..n)
        .map(|_| {
            let mut words = Vec::new();
            // Roughly 1.2 tokens per word for this vocabulary.
            for _ in 0..(tokens * 5 / 6).max(1) {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                words.push(WORDS[(state >> 33) as usize % WORDS.len()]);
            }
            words.join(" ")
        })
        .collect()
}

/// The CUDA op profile gathered since the last call (TERN_CUDA_PROFILE), as JSON rows
/// `{op, calls, ms}`; null when not profiling.
fn op_profile_json(ops: &tern::kernels::cuda_ops::CudaOps) -> serde_json::Value {
    match ops.take_op_profile() {
        Some(rows) => rows.iter().map(|(op, n, t)| serde_json::json!({"op": op, "calls": n, "ms": t * 1e3})).collect(),
        None => serde_json::Value::Null,
    }
}

fn run_bench_embed(args: BenchEmbedArgs) -> Result<()> {
    let t0 = Instant::now();
    let model = load_embedder(&args.model)?;
    let load_s = t0.elapsed().as_secs_f64();
    let (rss_loaded, _) = memory_usage();
    let opts = EmbedOptions { batch_tokens: usize::MAX, ..EmbedOptions::default() };
    let docs = match &args.input {
        Some(p) => read_lines(p)?,
        None => generated_documents(args.batch, args.doc_tokens),
    };
    if docs.is_empty() {
        return Err(Error::Input("no documents to benchmark with".into()));
    }
    let docs: Vec<&str> = docs.iter().cycle().take(args.batch.max(1)).map(|s| s.as_str()).collect();
    let (doc_ids, _) = model.tokenize(&docs, &opts)?;
    let (query_ids, _) = model.tokenize(&["what do terns eat?"], &opts)?;
    let time = |ids: &[Vec<u32>]| -> Result<(f64, usize)> {
        let t = Instant::now();
        let out = model.embed_ids(ids, &opts)?;
        Ok((t.elapsed().as_secs_f64(), out.tokens))
    };
    time(&doc_ids)?;
    let mut batch_times = Vec::new();
    let mut tokens = 0;
    for _ in 0..args.iters.max(1) {
        let (s, n) = time(&doc_ids)?;
        batch_times.push(s);
        tokens = n;
    }
    let cuda_ops = match &model.pipeline.model {
        tern::models::sentence::Placed::Cuda(s) => Some(s.encoder.ops()),
        _ => None,
    };
    let batch_profile = cuda_ops.map(op_profile_json);
    let query = query_ids;
    for _ in 0..3 {
        time(&query)?;
    }
    let mut query_times = Vec::new();
    for _ in 0..(args.iters.max(1) * 30) {
        query_times.push(time(&query)?.0);
    }
    let quantile = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    let query_profile = cuda_ops.map(op_profile_json);
    let batch_s = quantile(&mut batch_times, 0.5);
    let query_s = quantile(&mut query_times, 0.5);
    let query_p90 = quantile(&mut query_times, 0.9);
    let p = &model.pipeline;
    // The compute roofline for this work: the matrix-product rate of the same engine (the CPU
    // kernel, or cuBLAS in the run's precision), measured now on a projection-sized product.
    let (gemm_rate, device_weight_bytes) = match &p.model {
        tern::models::sentence::Placed::Cpu(_) => (model_gemm_rate(model.threads()), 0),
        tern::models::sentence::Placed::Cuda(s) => {
            let ops = s.encoder.ops();
            (ops.measure_gemm_rate(8192, 4096, 4096)?, ops.weight_bytes())
        }
    };
    // The fast mode's error, measured on these documents against f32 mode on the same GPU.
    let fast_vs_f32_min_cosine = match (&p.model, args.compare_f32) {
        (tern::models::sentence::Placed::Cuda(s), true) if s.encoder.ops().precision() == Precision::Bf16 => {
            let f32_args = ModelArgs { dtype: Precision::F32, ..args.model.clone() };
            let reference = load_embedder(&f32_args)?;
            let (a, b) = (model.embed_ids(&doc_ids, &opts)?, reference.embed_ids(&doc_ids, &opts)?);
            let cos = |x: &[f32], y: &[f32]| {
                let dot: f64 = x.iter().zip(y).map(|(&u, &v)| u as f64 * v as f64).sum();
                let n = |z: &[f32]| z.iter().map(|&u| (u as f64).powi(2)).sum::<f64>().sqrt();
                dot / (n(x) * n(y))
            };
            Some((0..a.len()).map(|i| cos(a.row(i), b.row(i))).fold(1.0f64, f64::min))
        }
        _ => None,
    };
    let graphs = match &p.model {
        tern::models::sentence::Placed::Cuda(s) => Some(s.encoder.ops().graph_stats()),
        _ => None,
    };
    let flops: f64 = doc_ids
        .iter()
        .map(|s| 2.0 * p.matmul_params_per_token() as f64 * s.len() as f64 + p.attention_flops(s.len()))
        .sum();
    let (rss, peak) = memory_usage();
    let weights_file: u64 = std::fs::metadata(p.dir.join("model.safetensors")).map_or(0, |m| m.len());
    let report = serde_json::json!({
        "model": p.dir.display().to_string(),
        "device": p.device(),
        "threads": model.threads(),
        "load_s": load_s,
        "batch": doc_ids.len(),
        "batch_tokens": tokens,
        "batch_s": batch_s,
        "tokens_per_s": tokens as f64 / batch_s,
        "query_tokens": query[0].len(),
        "query_latency_ms": query_s * 1e3,
        "query_p90_ms": query_p90 * 1e3,
        "batch_gflops_per_s": flops / batch_s / 1e9,
        "gemm_gflops_per_s": gemm_rate / 1e9,
        "roofline_fraction": flops / batch_s / gemm_rate,
        "device_weight_bytes": device_weight_bytes,
        "fast_vs_f32_min_cosine": fast_vs_f32_min_cosine,
        "cuda_graphs": graphs.map(|(recorded, failed)| serde_json::json!({"recorded": recorded, "failed": failed})),
        "op_profile": {"batch": batch_profile, "query": query_profile},
        "rss_after_load_bytes": rss_loaded,
        "rss_bytes": rss,
        "peak_rss_bytes": peak,
        "weights_file_bytes": weights_file,
        "peak_rss_over_weights": if weights_file > 0 { peak as f64 / weights_file as f64 } else { 0.0 },
    });
    println!("{report}");
    Ok(())
}

fn run_bench_generate(args: BenchGenerateArgs) -> Result<()> {
    use tern::models::qwen35::{PlacedQwen35, PlacedState};
    let threads = if args.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { args.threads };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::Input(format!("cannot start {threads} worker threads: {e}")))?;
    if args.prompt_tokens == 0 || args.gen_tokens == 0 {
        return Err(Error::Input("--prompt-tokens and --gen-tokens must be at least 1".into()));
    }
    if args.concurrent.contains(&0) || args.prefill_also.contains(&0) || args.decode_depth.contains(&0) {
        return Err(Error::Input("--concurrent, --prefill-also and --decode-depth sizes must be at least 1".into()));
    }
    let placement = LoadOptions { threads, max_tokens: None, device: args.device, dtype: args.dtype }.placement()?;
    pool.install(|| {
        let t0 = Instant::now();
        let model = PlacedQwen35::load(&args.model, &placement)?;
        let load_s = t0.elapsed().as_secs_f64();
        let c = model.cfg();
        // Random ids below the first special token (248044 in the released vocabulary), from a
        // fixed seed, so every run and every peer sees the same prompt.
        let id_range = c.vocab_size.min(248_044) as u64;
        let mut state = 0x2545f4914f6cdd1du64;
        let mut next_id = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % id_range) as u32
        };
        let prompt: Vec<u32> = (0..args.prompt_tokens).map(|_| next_id()).collect();
        let first = next_id();
        let median = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        // Each step's token as a greedy generation takes it (the sampler reads the step's
        // best entry, or with --full-logits the whole row).
        let mut greedy = Sampler::new(SamplingOptions::greedy())?;
        let want = if args.full_logits { LogitsWant::Full } else { greedy.wants() };

        // TERN_CUDA_PROFILE's op times since the last call (and cleared): each phase reports
        // its timed runs, not its warm-up (first-call costs such as cuBLAS's set-up).
        let profile = || match &model {
            PlacedQwen35::Cuda(q) => op_profile_json(q.ops()),
            PlacedQwen35::Cpu(_) => serde_json::Value::Null,
        };
        // Prefill: the whole prompt in one forward from an empty state, median of the timed runs.
        let time_prefill = |prompt: &[u32]| -> Result<f64> {
            let mut times = Vec::new();
            for i in 0..=args.iters.max(1) {
                let mut st = model.new_state()?;
                let t = Instant::now();
                std::hint::black_box(model.forward(prompt, &mut st)?);
                if i > 0 {
                    times.push(t.elapsed().as_secs_f64());
                } else {
                    profile();
                }
            }
            Ok(median(&mut times))
        };
        let prefill_s = time_prefill(&prompt)?;
        let prefill_profile = profile();
        let mut prefill_also = Vec::new();
        for &n in &args.prefill_also {
            let ids: Vec<u32> = (0..n).map(|_| next_id()).collect();
            let s = time_prefill(&ids)?;
            prefill_also.push(serde_json::json!({"prompt_tokens": n, "prefill_s": s, "prefill_tokens_per_s": n as f64 / s, "op_profile": profile()}));
        }

        // gen_tokens single-token steps on `st`, feeding back the greedy token, each step's time
        // pushed to `steps` when `timed`.
        let mut decode_run = |st: &mut PlacedState, steps: &mut Vec<f64>, timed: bool| -> Result<()> {
            let mut tok = first;
            for _ in 0..args.gen_tokens {
                let t = Instant::now();
                let logits = model.forward_want(&[tok], st, want)?;
                let dt = t.elapsed().as_secs_f64();
                tok = greedy.sample_step(logits, &[], &[]);
                if timed {
                    steps.push(dt);
                }
            }
            Ok(())
        };
        // Decode: from a fresh state, the median step over the timed runs (after one warm-up).
        let mut per_token = Vec::new();
        let mut run_means = Vec::new();
        for i in 0..=args.iters.max(1) {
            let mut st = model.new_state()?;
            let t_run = Instant::now();
            decode_run(&mut st, &mut per_token, i > 0)?;
            if i > 0 {
                run_means.push(t_run.elapsed().as_secs_f64() / args.gen_tokens as f64);
            } else {
                profile();
            }
        }
        let decode_s = median(&mut per_token);
        let decode_mean_s = median(&mut run_means);
        let decode_profile = profile();

        // Decode after a prompt of each depth: the same steps after a prefill of `depth`
        // tokens (untimed).
        let mut at_depth = Vec::new();
        for &depth in &args.decode_depth {
            let ids: Vec<u32> = (0..depth).map(|_| next_id()).collect();
            let mut steps = Vec::new();
            for i in 0..=args.iters.max(1) {
                let mut st = model.new_state()?;
                model.forward(&ids, &mut st)?;
                decode_run(&mut st, &mut steps, i > 0)?;
            }
            at_depth.push((depth, median(&mut steps)));
        }

        // Decode rounds of B sequences at once (the server's continuous-batching step).
        let mut concurrent = Vec::new();
        for &b in &args.concurrent {
            let mut states: Vec<PlacedState> = (0..b).map(|_| model.new_state()).collect::<Result<_>>()?;
            for s in states.iter_mut() {
                model.forward(&prompt[..prompt.len().min(16)], s)?;
            }
            let mut toks: Vec<[u32; 1]> = (0..b).map(|_| [first]).collect();
            let mut rounds = Vec::new();
            for step in 0..args.gen_tokens {
                let mut batch: Vec<(&[u32], &mut PlacedState)> = toks.iter().map(|t| t.as_slice()).zip(states.iter_mut()).collect();
                let t = Instant::now();
                let logits = model.forward_batch_wants(&mut batch, &vec![want; b])?;
                if step > 0 {
                    rounds.push(t.elapsed().as_secs_f64());
                }
                for (t, l) in toks.iter_mut().zip(logits) {
                    t[0] = greedy.sample_step(l, &[], &[]);
                }
            }
            let round = if rounds.is_empty() { f64::NAN } else { median(&mut rounds) };
            concurrent.push(serde_json::json!({"sequences": b, "round_s": round, "tokens_per_s": b as f64 / round}));
        }

        let concurrent_profile = profile();
        // Memory before the probes below, whose buffers would otherwise count as the model's.
        let (rss, peak) = memory_usage();
        // Rooflines, measured now on the same device: the memory bandwidth (CPU: a read of 1
        // GiB past every cache; GPU: a 1 GiB device copy, bytes read + written) and the GEMM
        // rate (the run's precision) on a prefill-shaped projection [n × 1024] · [1024 × 3584].
        let m = args.prompt_tokens.max(64);
        let (bandwidth, gemm_rate, device_bytes) = match &model {
            PlacedQwen35::Cpu(_) => (
                tern::kernels::matmul::measure_read_bandwidth(1 << 30, 5),
                tern::kernels::matmul::measure_rate(m, 3584, 1024, 3).unwrap_or(f64::NAN),
                0,
            ),
            PlacedQwen35::Cuda(q) => (q.ops().measure_copy_bandwidth(1 << 30)?, q.ops().measure_gemm_rate(m, 3584, 1024)?, q.ops().weight_bytes()),
        };
        let bytes_per_token = model.decode_bytes_per_token(args.gen_tokens / 2);
        let decode_at_depth: Vec<_> = at_depth
            .iter()
            .map(|&(depth, step)| {
                let bytes = model.decode_bytes_per_token(depth + args.gen_tokens / 2);
                serde_json::json!({
                    "depth": depth,
                    "decode_tokens_per_s": 1.0 / step,
                    "decode_bytes_per_token": bytes,
                    "decode_bandwidth_fraction": bytes as f64 / step / bandwidth,
                })
            })
            .collect();
        let flops = model.prefill_flops(args.prompt_tokens);
        // Decode steps recorded as CUDA graphs, and why any recording failed.
        let graphs = match &model {
            PlacedQwen35::Cpu(_) => serde_json::Value::Null,
            PlacedQwen35::Cuda(q) => {
                let (recorded, failed) = q.ops().graph_stats();
                serde_json::json!({ "recorded": recorded, "failed": failed })
            }
        };
        let report = serde_json::json!({
            "model": args.model.display().to_string(),
            "device": model.device(),
            "threads": threads,
            "load_s": load_s,
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": args.prompt_tokens as f64 / prefill_s,
            "prefill_also": prefill_also,
            "decode_tokens_per_s": 1.0 / decode_s,
            "decode_tokens_per_s_mean": 1.0 / decode_mean_s,
            "decode_logits": if args.full_logits { "whole rows to the host" } else { "greedy token's entry" },
            "decode_at_depth": decode_at_depth,
            "concurrent_decode": concurrent,
            "cuda_graphs": graphs,
            "op_profile": {"prefill": prefill_profile, "decode": decode_profile, "concurrent": concurrent_profile},
            "weight_bytes": model.weight_bytes(),
            "device_weight_bytes": device_bytes,
            "decode_bytes_per_token": bytes_per_token,
            "read_bandwidth_gb_per_s": bandwidth / 1e9,
            "decode_bandwidth_fraction": bytes_per_token as f64 / decode_s / bandwidth,
            "prefill_flops": flops,
            "prefill_gflops_per_s": flops / prefill_s / 1e9,
            "gemm_gflops_per_s": gemm_rate / 1e9,
            "prefill_gemm_fraction": flops / prefill_s / gemm_rate,
            "rss_bytes": rss,
            "peak_rss_bytes": peak,
        });
        println!("{report}");
        Ok(())
    })
}
