//! The CUDA matmul: cuBLAS GEMMs (the tool NVIDIA tunes per architecture; a hand-written
//! kernel would have to beat it per shape, and for these large dense products it does not
//! need to be beaten) plus two helper kernels in `convert.cu`.
//!
//! Row-major `Y[rows][out] = X[rows][in] · W[out][in]ᵀ` is, in cuBLAS's column-major terms,
//! `Yᵀ = op(W)·Xᵀ` with W read as an `in × out` matrix and transposed: m = out, n = rows,
//! k = in, lda = ldb = in, ldc = out. No copy or transpose of either operand is made.
//!
//! Two precisions: f32 (`CUBLAS_COMPUTE_32F` on f32 operands: plain SGEMM, never TF32, so the
//! f32 mode differs from the CPU only by summation order) and bf16 (bf16 weights and a bf16
//! copy of X, f32 accumulation and f32 output: the tensor-core fast mode).

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};

use crate::cuda::{cublas_available, driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig, PushKernelArg};
use crate::error::{Error, Result};
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_matmul", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("convert.cu")) };

/// A weight matrix on the device, [out][in].
pub enum GpuWeights {
    F32(CudaSlice<f32>),
    /// bf16 bits (round-to-nearest-even from the f32 weights).
    Bf16(CudaSlice<u16>),
}

pub struct GpuMatrix {
    pub w: GpuWeights,
    pub out: usize,
    pub inp: usize,
}

impl GpuMatrix {
    pub fn bytes(&self) -> usize {
        match &self.w {
            GpuWeights::F32(w) => 4 * w.len(),
            GpuWeights::Bf16(w) => 2 * w.len(),
        }
    }
}

/// A cuBLAS handle on the GPU's stream, and the helper kernels.
pub struct Blas {
    gpu: Arc<Gpu>,
    handle: CudaBlas,
    to_bf16: CudaFunction,
    add_bias: CudaFunction,
}

fn blas_err(what: &str) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}

impl Blas {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        cublas_available()?;
        let handle = CudaBlas::new(gpu.stream().clone()).map_err(blas_err("creating the cuBLAS handle"))?;
        Ok(Blas { to_bf16: gpu.function(&SOURCE, "tern_to_bf16")?, add_bias: gpu.function(&SOURCE, "tern_add_bias")?, handle, gpu })
    }

    /// Uploads an f32 weight matrix [out][in], converted to bf16 when `bf16`.
    pub fn matrix(&self, w: &[f32], out: usize, inp: usize, bf16: bool) -> Result<GpuMatrix> {
        check_len("matrix", w.len(), out * inp)?;
        let w = if bf16 {
            let bits: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            GpuWeights::Bf16(self.gpu.upload(&bits)?)
        } else {
            GpuWeights::F32(self.gpu.upload(w)?)
        };
        Ok(GpuMatrix { w, out, inp })
    }

    /// y = bf16(x), elementwise. CPU twin: `half::bf16::from_f32`.
    pub fn to_bf16(&self, x: &CudaSlice<f32>, y: &mut CudaSlice<u16>) -> Result<()> {
        check_len("to_bf16 output", y.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let (xp, yp, n) = (g.ptr(x), g.ptr(y), x.len() as u64);
        let mut l = g.stream().launch_builder(&self.to_bf16);
        l.arg(&xp).arg(&n).arg(&yp);
        let cfg = LaunchConfig { grid_dim: (grid_for(x.len(), 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; both buffers hold n elements.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_to_bf16"))?;
        Ok(())
    }

    /// y[r] += bias per row of bias.len().
    pub fn add_bias(&self, y: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<()> {
        if bias.is_empty() || y.len() % bias.len() != 0 {
            return Err(Error::Shape(format!("add_bias: {} elements are not rows of {}", y.len(), bias.len())));
        }
        let g = &self.gpu;
        let (rows, d) = (int_arg("bias rows", y.len() / bias.len())?, int_arg("bias width", bias.len())?);
        let (yp, bp) = (g.ptr(y), g.ptr(bias));
        let mut l = g.stream().launch_builder(&self.add_bias);
        l.arg(&yp).arg(&bp).arg(&rows).arg(&d);
        let cfg = LaunchConfig { grid_dim: (grid_for(y.len(), 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; y holds rows × d.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_add_bias"))?;
        Ok(())
    }

    /// Y = X·Wᵀ. `x` is f32 for f32 weights; for bf16 weights `x16` must hold X as bf16 (see
    /// [`Blas::to_bf16`]). CPU twin: [`super::linear`].
    pub fn linear(&self, x: Option<&CudaSlice<f32>>, x16: Option<&CudaSlice<u16>>, rows: usize, w: &GpuMatrix, y: &mut CudaSlice<f32>) -> Result<()> {
        check_len("linear output", y.len(), rows * w.out)?;
        if rows == 0 || w.out == 0 {
            return Ok(());
        }
        let (m, n, k) = (int_arg("linear out", w.out)?, int_arg("linear rows", rows)?, int_arg("linear in", w.inp)?);
        let g = &self.gpu;
        let (wp, a_type, xp, b_type) = match (&w.w, x, x16) {
            (GpuWeights::F32(wd), Some(x), _) => {
                check_len("linear input", x.len(), rows * w.inp)?;
                (g.ptr(wd), blas_sys::cudaDataType_t::CUDA_R_32F, g.ptr(x), blas_sys::cudaDataType_t::CUDA_R_32F)
            }
            (GpuWeights::Bf16(wd), _, Some(x16)) => {
                check_len("linear input", x16.len(), rows * w.inp)?;
                (g.ptr(wd), blas_sys::cudaDataType_t::CUDA_R_16BF, g.ptr(x16), blas_sys::cudaDataType_t::CUDA_R_16BF)
            }
            _ => return Err(Error::Shape("linear: the input's precision does not match the weights'".into())),
        };
        let yp = g.ptr(y);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: W holds out × in, X rows × in and Y rows × out elements of the types named
        // (checked above); the handle is bound to the GPU's stream.
        unsafe {
            blas::gemm_ex(
                *self.handle.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha as *const f32 as *const _,
                wp as *const _,
                a_type,
                k,
                xp as *const _,
                b_type,
                k,
                &beta as *const f32 as *const _,
                yp as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                m,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("cuBLAS GEMM"))
    }
}
