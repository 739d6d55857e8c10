//! Models written once over the op set: weight-name mapping, config validation, forward passes.

pub mod egemma;
pub mod qwen35;
pub mod sentence;
