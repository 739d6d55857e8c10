//! Models written once over the op set: weight-name mapping, config validation, forward passes.

pub mod egemma;
pub mod qwen35;
#[cfg(test)]
mod qwen35_cuda_tests;
pub mod sentence;

/// Where to load a model: the CPU, or a GPU with a precision.
#[derive(Clone, Debug, Default)]
pub enum Placement {
    #[default]
    Cpu,
    Cuda(std::sync::Arc<crate::cuda::Gpu>, crate::kernels::cuda_ops::Precision),
}
