//! tern: an inference engine for EmbeddingGemma embeddings and Qwen3.5 hybrid LLMs.
//!
//! Layers, each depending only on the ones above it in this list:
//! - [`formats`]: safetensors and JSON configuration readers (memory-mapped, zero-copy), dtype
//!   decoding. No compute.
//! - [`cuda`]: the CUDA device plumbing (context, stream, NVRTC with its cache, buffers) that
//!   the kernel families' CUDA forms launch through; absent GPUs mean the CPU path.
//! - [`kernels`]: the op set, one module per kernel family, each entry point validating shapes.
//! - [`models`]: weight-name mapping, config validation and forward passes written once over the
//!   op set.
//! - [`runtime`]: tokenizer, prompts and chat templates, the embedding batcher, the sampler and
//!   generation loop, model resolution.
//! - [`server`]: the OpenAI-compatible HTTP server (`tern serve`).
//!
//! The library entry point for embeddings is [`runtime::embed::Embedder`]: load once, embed many.

pub mod cuda;
pub mod error;
pub mod formats;
pub mod kernels;
pub mod models;
pub mod runtime;
pub mod server;

pub use error::{Error, Result};
