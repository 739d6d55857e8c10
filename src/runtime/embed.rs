//! The embedding API: load a model once, embed many texts.
//!
//! ```no_run
//! use tern::runtime::embed::{EmbedOptions, Embedder, LoadOptions};
//! let model = Embedder::load("path/to/embeddinggemma-300m".as_ref(), &LoadOptions::default())?;
//! let opts = EmbedOptions { prompt_name: Some("query".into()), ..EmbedOptions::default() };
//! let out = model.embed(&["what is a tern?"], &opts)?;
//! assert_eq!(out.dim, 768);
//! # Ok::<(), tern::Error>(())
//! ```
//!
//! Texts are tokenized (prompt first), packed end to end without padding into batches of at
//! most `batch_tokens` tokens, and run through the pipeline. Each sequence attends only to
//! itself and is pooled alone, so a text's embedding does not depend on its batch-mates.

use std::path::Path;

use crate::cuda::DeviceSpec;
use crate::error::{Error, Result};
use crate::kernels::cuda_ops::Precision;
use crate::kernels::pack;
use crate::models::sentence::{Placement, SentencePipeline};
use crate::runtime::tokenizer::Tokenizer;

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Lower the model's token limit (never raise it).
    pub max_tokens: Option<usize>,
    /// Where to run. `Auto` takes the first GPU when a CUDA driver, a device and cuBLAS are
    /// present, else the CPU.
    pub device: DeviceSpec,
    /// GEMM precision on a GPU (bf16 needs one).
    pub dtype: Precision,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { threads: 0, max_tokens: None, device: DeviceSpec::Auto, dtype: Precision::F32 }
    }
}

impl LoadOptions {
    /// The placement these options name; an explicit GPU that cannot be used is an error.
    pub fn placement(&self) -> Result<Placement> {
        let usable_auto = || crate::cuda::device_count() > 0 && crate::cuda::cublas_available().is_ok();
        let gpu = match self.device {
            DeviceSpec::Cpu => None,
            DeviceSpec::Auto if !usable_auto() => None,
            spec => spec.open()?,
        };
        match gpu {
            Some(gpu) => Ok(Placement::Cuda(gpu, self.dtype)),
            None if self.dtype == Precision::F32 => Ok(Placement::Cpu),
            None => Err(Error::Input(format!(
                "--dtype {}: the fast mode runs on a CUDA GPU, and this run is on the CPU (f32 only)",
                self.dtype
            ))),
        }
    }
}

#[derive(Clone, Debug)]
pub struct EmbedOptions {
    /// A prompt by its name in config_sentence_transformers.json.
    pub prompt_name: Option<String>,
    /// A literal prompt (takes precedence over `prompt_name`).
    pub prompt: Option<String>,
    /// Matryoshka truncation to this many leading dimensions (then re-normalised).
    pub dimensions: Option<usize>,
    /// L2-normalise the output (the pipeline's Normalize module and the final normalisation).
    pub normalize: bool,
    /// Cut over-long inputs to the limit (true) or refuse them (false).
    pub truncate: bool,
    /// Token budget of one packed batch.
    pub batch_tokens: usize,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        EmbedOptions { prompt_name: None, prompt: None, dimensions: None, normalize: true, truncate: true, batch_tokens: 8192 }
    }
}

/// Embeddings of n inputs, row-major [n][dim], and the inputs that were cut to the limit.
#[derive(Debug)]
pub struct Embeddings {
    pub dim: usize,
    pub data: Vec<f32>,
    /// (input index, tokens before the cut) for each truncated input.
    pub truncated: Vec<(usize, usize)>,
    /// Tokens processed, prompt and special tokens included.
    pub tokens: usize,
}

impl Embeddings {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }
    pub fn len(&self) -> usize {
        if self.dim == 0 { 0 } else { self.data.len() / self.dim }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One loaded model serves many threads (the server shares it between requests).
const _: () = {
    const fn assert_sync<T: Send + Sync>() {}
    assert_sync::<Embedder>();
};

pub struct Embedder {
    pub pipeline: SentencePipeline,
    pub tokenizer: Tokenizer,
    pool: rayon::ThreadPool,
}

impl Embedder {
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Embedder> {
        let pipeline = SentencePipeline::load_on(dir, &opts.placement()?)?;
        let limit = opts.max_tokens.map_or(pipeline.max_seq_length, |m| m.min(pipeline.max_seq_length));
        let tokenizer = Tokenizer::load(dir, limit)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads)
            .build()
            .map_err(|e| Error::Input(format!("cannot start {} threads: {e}", opts.threads)))?;
        Ok(Embedder { pipeline, tokenizer, pool })
    }

    pub fn dim(&self) -> usize {
        self.pipeline.dim()
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The prompt text that `opts` selects, checked against the model's prompt names.
    pub fn prompt_text(&self, opts: &EmbedOptions) -> Result<String> {
        if let Some(p) = &opts.prompt {
            return Ok(p.clone());
        }
        let name = opts.prompt_name.as_ref().or(self.pipeline.default_prompt_name.as_ref());
        match name {
            None => Ok(String::new()),
            Some(n) => self.pipeline.prompts.get(n).cloned().ok_or_else(|| {
                let known: Vec<&str> = self.pipeline.prompts.keys().map(|s| s.as_str()).collect();
                Error::Input(format!(
                    "unknown prompt name `{n}`; this model has: {}",
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                ))
            }),
        }
    }

    pub fn check_dimensions(&self, opts: &EmbedOptions) -> Result<usize> {
        let dim = self.dim();
        match opts.dimensions {
            None => Ok(dim),
            Some(d) if d >= 1 && d <= dim => Ok(d),
            Some(d) => Err(Error::Input(format!("--dimensions {d}: this model's embeddings have 1..={dim} dimensions"))),
        }
    }

    /// Token ids of each text with the selected prompt, cut (or refused) at the limit.
    pub fn tokenize(&self, texts: &[&str], opts: &EmbedOptions) -> Result<(Vec<Vec<u32>>, Vec<(usize, usize)>)> {
        let prompt = self.prompt_text(opts)?;
        let mut ids = Vec::with_capacity(texts.len());
        let mut truncated = Vec::new();
        for (i, text) in texts.iter().enumerate() {
            let t = if prompt.is_empty() {
                self.tokenizer.encode(text)?
            } else {
                self.tokenizer.encode(&format!("{prompt}{text}"))?
            };
            if let Some(n) = t.truncated_from {
                if !opts.truncate {
                    return Err(Error::Input(format!(
                        "input {i} has {n} tokens, over the model's limit of {} (without --no-truncate it would be cut)",
                        self.tokenizer.max_tokens()
                    )));
                }
                truncated.push((i, n));
            }
            ids.push(t.ids);
        }
        Ok((ids, truncated))
    }

    pub fn embed(&self, texts: &[&str], opts: &EmbedOptions) -> Result<Embeddings> {
        self.embed_with_progress(texts, opts, |_| {})
    }

    /// As [`Embedder::embed`], calling `progress(done)` after each batch.
    pub fn embed_with_progress(
        &self,
        texts: &[&str],
        opts: &EmbedOptions,
        progress: impl FnMut(usize),
    ) -> Result<Embeddings> {
        if texts.is_empty() {
            return Err(Error::Input("no inputs to embed".into()));
        }
        self.check_dimensions(opts)?;
        let (ids, truncated) = self.tokenize(texts, opts)?;
        let mut out = self.embed_ids_with_progress(&ids, opts, progress)?;
        out.truncated = truncated;
        Ok(out)
    }

    /// Embeds token-id sequences (special tokens included, as the tokenizer would give them).
    pub fn embed_ids(&self, ids: &[Vec<u32>], opts: &EmbedOptions) -> Result<Embeddings> {
        self.embed_ids_with_progress(ids, opts, |_| {})
    }

    fn embed_ids_with_progress(
        &self,
        ids: &[Vec<u32>],
        opts: &EmbedOptions,
        mut progress: impl FnMut(usize),
    ) -> Result<Embeddings> {
        if ids.is_empty() {
            return Err(Error::Input("no inputs to embed".into()));
        }
        let out_dim = self.check_dimensions(opts)?;
        let limit = self.tokenizer.max_tokens();
        for (i, s) in ids.iter().enumerate() {
            if s.is_empty() {
                return Err(Error::Input(format!("input {i} has no tokens")));
            }
            if s.len() > limit {
                return Err(Error::Input(format!("input {i} has {} tokens, over the model's limit of {limit}", s.len())));
            }
        }
        let dim = self.dim();
        let budget = opts.batch_tokens.max(1);
        let mut data = Vec::with_capacity(ids.len() * out_dim);
        let mut start = 0;
        let mut tokens = 0;
        while start < ids.len() {
            // Take inputs in order until the budget is spent (always at least one).
            let mut end = start + 1;
            let mut used = ids[start].len();
            while end < ids.len() && used + ids[end].len() <= budget {
                used += ids[end].len();
                end += 1;
            }
            let batch = &ids[start..end];
            for row in self.pipeline_rows(batch, opts.normalize)?.chunks(dim) {
                data.extend_from_slice(&self.finish_row(row, out_dim, opts.normalize)?);
            }
            tokens += used;
            start = end;
            progress(start);
        }
        Ok(Embeddings { dim: out_dim, data, truncated: Vec::new(), tokens })
    }

    /// The pipeline's output for one packed batch of sequences, [n][dim], before Matryoshka.
    /// Each sequence attends only to itself, so a row does not depend on its batch-mates.
    pub fn pipeline_rows(&self, batch: &[Vec<u32>], normalize: bool) -> Result<Vec<f32>> {
        let flat: Vec<u32> = batch.iter().flatten().copied().collect();
        let segments = pack(batch.iter().map(|s| s.len()));
        self.pool.install(|| self.pipeline.forward(&flat, &segments, normalize))
    }

    /// One returned embedding from a pipeline row: the first `out_dim` values, normalised as
    /// `encode(normalize_embeddings=True)` does (after the Matryoshka cut, whether or not the
    /// pipeline ends in Normalize).
    pub fn finish_row(&self, row: &[f32], out_dim: usize, normalize: bool) -> Result<Vec<f32>> {
        let mut v = row[..out_dim].to_vec();
        if normalize {
            crate::kernels::pool::l2_normalize(&mut v, out_dim)?;
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_follows_device_and_dtype() {
        let cpu = LoadOptions { device: DeviceSpec::Cpu, ..LoadOptions::default() };
        assert!(matches!(cpu.placement().unwrap(), Placement::Cpu));
        let cpu_bf16 = LoadOptions { dtype: Precision::Bf16, ..cpu };
        match cpu_bf16.placement() {
            Err(Error::Input(m)) => assert!(m.contains("bf16") && m.contains("CPU"), "{m}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        if crate::cuda::device_count() == 0 {
            // No GPU: auto is the CPU, an explicit GPU is an error naming the driver.
            assert!(matches!(LoadOptions::default().placement().unwrap(), Placement::Cpu));
            let cuda = LoadOptions { device: DeviceSpec::Cuda(0), ..LoadOptions::default() };
            assert!(matches!(cuda.placement(), Err(Error::Cuda(_))));
        }
    }
}
