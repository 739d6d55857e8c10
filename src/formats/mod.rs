//! File formats: weights and configuration readers. No compute happens here beyond dtype decoding.

pub mod config;
pub mod gguf;
pub mod npy;
pub mod safetensors;
pub mod tensor;

pub use tensor::{Bf16Tensor, Matrix, Q8Tensor, Tensor};
