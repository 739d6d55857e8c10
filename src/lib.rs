//! tern: an inference engine for EmbeddingGemma embeddings and Qwen3.5 hybrid LLMs.
//!
//! Layers, each depending only on the ones above it in this list:
//! - [`formats`]: safetensors and JSON configuration readers (memory-mapped, zero-copy), dtype
//!   decoding. No compute.
//! - [`kernels`]: the op set, one module per kernel family, each entry point validating shapes.
//! - [`models`]: weight-name mapping, config validation and forward passes written once over the
//!   op set.
//! - [`cuda`]: the CUDA device plumbing (context, stream, NVRTC with its cache, buffers) that
//!   the kernel families' CUDA forms launch through; absent GPUs mean the CPU path.
//! - [`runtime`]: tokenizer, prompts, the embedding batcher, model resolution.
//!
//! The library entry point for embeddings is [`runtime::embed::Embedder`]: load once, embed many.

pub mod cuda;
pub mod error;
pub mod formats;
pub mod kernels;
pub mod models;
pub mod runtime;

pub use error::{Error, Result};
