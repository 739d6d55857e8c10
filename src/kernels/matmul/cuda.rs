//! The CUDA matmul: a GEMV kernel for a few rows (decode, `gemv.cu`), cuBLAS GEMMs for more
//! (the tool NVIDIA tunes per architecture; a hand-written kernel would have to beat it per
//! shape, and for these large dense products it does not need to be beaten), and the helper
//! kernels in `convert.cu`.
//!
//! Weights stay on the device in their stored type (f32, bf16, or Q8_0 repacked into quants
//! and scales), so that decode, which reads every weight once per step, reads as few bytes as
//! the file holds. A GEMM takes them as its operand type: f32 in the f32 mode (bf16 and Q8_0
//! expanded exactly, into a scratch buffer, just before the product: at the row counts that
//! reach the GEMM the product's arithmetic dwarfs that copy), bf16 in the fast mode.
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

use crate::cuda::{cublas_available, driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN_SMEM;
use cudarc::driver::DeviceRepr;
use crate::error::{Error, Result};
use crate::kernels::backend::{check_view, View};
use crate::kernels::check_len;
use super::q8_0::{BLOCK, BLOCK_BYTES};
use crate::kernels::matmul::Weights;

pub const SOURCE: KernelSource = KernelSource {
    name: "tern_matmul",
    code: concat!(
        include_str!("../prelude.cuh"),
        "\n",
        include_str!("../gated_delta/cuda/conv_sum.cuh"),
        "\n",
        include_str!("convert.cu"),
        "\n",
        include_str!("gemv.cu"),
        "\n",
        include_str!("gemm_q8.cu")
    ),
};

/// Products of at most this many rows take the GEMV kernel (they read the weights once, and
/// a GEMM's tiles would be mostly empty).
pub const GEMV_MAX_ROWS: usize = 8;
/// The most rows fast mode's products of Q8_0 weights take on the tensor-core GEMV, in tiles of
/// [`GEMV_MAX_ROWS`] ([`Blas::linear`]), where a GEMM would expand the whole matrix to bf16 first:
/// [prompts and other products, a decode step's]. The two differ because a decode step replays
/// from a graph, where only the GPU's time counts, while a prompt's products are launched one by
/// one, and the GEMM's three launches (expansion, x to bf16, the GEMM) cost host time the tiles'
/// one does not. H100, Qwen3.5-0.8B's Q8_0 GGUF, fast mode, tok/s with the tiles against the
/// GEMM, same call, since the expansion runs at the copy rate (BENCHMARKS.md, twenty-sixth
/// session): rounds of 16 sequences 6 715 / 6 720 against 6 302, of 32 8 643 / 8 662 against
/// 10 922, of 48 9 765 / 9 795 against 14 379; prompts of 16 tokens 5 175 / 5 230 against 3 870,
/// of 32 7 084 / 7 174 against 6 521, of 48 7 893 / 7 943 against 8 247.
pub const MMA_ROW_TILES_MAX_ROWS: [usize; 2] = [32, 16];
/// The most rows fast mode's products of Q8_0 weights take on `tern_gemm_q8` (the quants read
/// as stored) past the row tiles' bound, where a GEMM would expand the whole matrix to bf16
/// first; TERN_GEMM_Q8_ROWS sets it. 0 (off): this first form is slower than the expansion
/// and cuBLAS's GEMM. H100, Qwen3.5-0.8B's Q8_0 GGUF, fast mode, tok/s with it (bound 256)
/// against without, same call (BENCHMARKS.md, twenty-sixth session): rounds of 32 / 64 / 128
/// sequences 9 632 / 15 567 / 19 514 against 10 971 / 17 464 / 25 053; prompts of 128 / 256
/// tokens 22 616 / 35 190 against 28 291 / 49 967; of 512 level (83 055 against 81 433).
pub const GEMM_Q8_MAX_ROWS: usize = 0;
/// `tern_gemm_q8`'s tile: features and rows a block, weights of k a stage, stages in flight
/// (gemm_q8.cu), and its dynamic shared memory (the staged bf16 rows, padded by 32 values).
const GEMM_Q8_TILE: (usize, usize, usize, usize) = (64, 64, 128, 3);
const GEMM_Q8_SMEM_BYTES: usize = GEMM_Q8_TILE.3 * GEMM_Q8_TILE.1 * (GEMM_Q8_TILE.2 + 32) * 2;
/// Blocks a multiprocessor `tern_gemm_q8` aims at (three fit: 138 registers and 61 KB of shared
/// memory a block of 128 threads): products of few features (a 1024-feature projection)
/// split k to reach them.
const GEMM_Q8_BLOCKS_PER_SM: usize = 2;
/// Most scratch bytes a prompt's MoE products expand Q8_0 experts into at once
/// ([`Blas::grouped_linear`]): a chunk of experts per launch, not the whole layer's. The unit
/// tests' tiny experts take many chunks.
const EXPAND_CHUNK_BYTES: usize = if cfg!(test) { 64 << 10 } else { 256 << 20 };
/// Output features per GEMV block (one warp each; TERN_GEMV_WARPS).
const GEMV_WARPS: usize = 8;

/// A weight matrix on the device, [out][in], in its stored type.
pub enum GpuWeights {
    F32(CudaSlice<f32>),
    /// bf16 bits: as stored, or rounded to nearest even from f32 in the fast mode.
    Bf16(CudaSlice<u16>),
    /// Q8_0 repacked: the quants [out][in] and one f16 scale (bits) per 32 weights of a row.
    Q8 { quants: CudaSlice<i8>, scales: CudaSlice<u16> },
}

/// [`GpuMatrix::kind`] of bf16 and of Q8_0 weights (the kernels' tables are [f32, bf16, Q8_0]).
const KIND_BF16: usize = 1;
const KIND_Q8: usize = 2;

pub struct GpuMatrix {
    pub w: GpuWeights,
    pub out: usize,
    pub inp: usize,
}

impl GpuMatrix {
    /// The weights' device address and (Q8_0) the scales', else 0: what a GEMV kernel takes.
    fn pointers(&self, gpu: &Gpu) -> (u64, u64) {
        match &self.w {
            GpuWeights::F32(d) => (gpu.ptr(d), 0),
            GpuWeights::Bf16(d) => (gpu.ptr(d), 0),
            GpuWeights::Q8 { quants, scales } => (gpu.ptr(quants), gpu.ptr(scales)),
        }
    }

    /// The index of the stored type in the GEMV kernel tables (f32, bf16, Q8_0).
    fn kind(&self) -> usize {
        match &self.w {
            GpuWeights::F32(_) => 0,
            GpuWeights::Bf16(_) => KIND_BF16,
            GpuWeights::Q8 { .. } => KIND_Q8,
        }
    }

    /// Device bytes of the weights (what a decode step reads).
    pub fn bytes(&self) -> usize {
        match &self.w {
            GpuWeights::F32(w) => 4 * w.len(),
            GpuWeights::Bf16(w) => 2 * w.len(),
            GpuWeights::Q8 { quants, scales } => quants.len() + 2 * scales.len(),
        }
    }
}

/// Matrices of one shape and stored type (a MoE layer's experts), addressed by an index that
/// the device reads: tables of their weights' (and Q8_0 scales') addresses. The matrices
/// themselves stay where they are; the table is valid while they live (the owner keeps both).
pub struct GpuMatrixTable {
    weights: CudaSlice<u64>,
    scales: CudaSlice<u64>,
    kind: usize,
    pub len: usize,
    pub out: usize,
    pub inp: usize,
}

/// What a GEMV writes (`TERN_Y_*` in gemv.cu): each output feature, or, for a matrix stacking
/// a gate [h][in] over an up [h][in], the gated activation act(gate)·up of each of the h pairs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GemvOutput {
    Plain,
    Silu,
    GeluTanh,
    /// Added to the residual stream, then its RMS norm ([`Blas::linear_residual_norm`]).
    Residual,
    /// Written, then the sandwich-norm step after it ([`Blas::linear_add_norm_next`]).
    AddNorm,
}

impl GemvOutput {
    fn index(self) -> usize {
        match self {
            GemvOutput::Plain => 0,
            GemvOutput::Silu => 1,
            GemvOutput::GeluTanh => 2,
            GemvOutput::Residual => 3,
            GemvOutput::AddNorm => 4,
        }
    }

    fn gated(self) -> bool {
        matches!(self, GemvOutput::Silu | GemvOutput::GeluTanh)
    }

    /// Output features of a product with `w` in this mode.
    pub(crate) fn features(self, w: &GpuMatrix) -> usize {
        if self.gated() {
            w.out / 2
        } else {
            w.out
        }
    }
}

/// Products one GEMV launch runs side by side (`TERN_GEMV_PARTS`).
pub const GEMV_PARTS: usize = 4;

/// Mirrors `tern_gemv_parts` in gemv.cu field for field (C layout), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GemvParts {
    w: [u64; GEMV_PARTS],
    scales: [u64; GEMV_PARTS],
    y: [u64; GEMV_PARTS],
    out: [i32; GEMV_PARTS],
    block0: [i32; GEMV_PARTS + 1],
    n: i32,
    ks: i32,
    /// The kernel's norm_w .. post fields (same offsets: the nested struct is 8-aligned as its
    /// first field, which follows `ks` at the same padded offset).
    tail: NormTail,
    /// The kernel's conv_w .. conv_part fields.
    conv: ConvTail,
    /// The kernel's up and up_ld (TERN_Y_GELU_BY): the view the product's gelu multiplies.
    up: u64,
    up_ld: i64,
    /// One-row kernels: 1, each warp requests its first weights before awaiting the prior
    /// kernel ([`Blas::gemv_early`]); 2, the kernel also lets the next be scheduled first
    /// ([`Gpu::early_trigger`]).
    early: i32,
    /// One-row kernels: the product's input formed as rms(in_h)·in_w by every block, block 0
    /// also writing it to in_a ([`Blas::linear_residual_norm_then`]); in_h 0: the input is x.
    in_eps: f32,
    in_h: u64,
    in_w: u64,
    in_a: u64,
}

/// The causal conv1d + SiLU a one-row GEMV applies to one part's outputs as it writes them (the
/// conv_w .. conv_part fields of `tern_gemv_parts`; zero: none). Its width is the kernel's.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ConvTail {
    /// Weights [channels][k].
    w: u64,
    /// The sequence's history [channels][k - 1].
    at: u64,
    /// 1 + the part convolved; 0: none.
    part: i32,
}
// SAFETY: plain integers in the kernel's C layout.
unsafe impl DeviceRepr for GemvParts {}

/// What a GEMV launch adds to its products ([`Blas::gemv_with`]): the norm after a residual
/// product ([`GemvOutput::Residual`], [`GemvOutput::AddNorm`]: one part); the causal conv1d +
/// SiLU of one part's outputs as they are written (one row, plain outputs, the CUDA-core form);
/// the input formed as a norm of the residual stream (one row, the CUDA-core form). The callers
/// check the conditions.
#[derive(Clone, Copy, Default)]
struct GemvExtras {
    tail: Option<NormTail>,
    conv: Option<(ConvTail, usize)>,
    normed: Option<NormedIn>,
}

/// The residual stream h [in], the norm's weight w [in], epsilon, and where block 0 writes
/// rms(h)·w (device addresses).
#[derive(Clone, Copy)]
struct NormedIn {
    h: u64,
    w: u64,
    a: u64,
    eps: f32,
}

/// The GEMV kernels: [output kind][weight type: f32, bf16, Q8_0][row bound R: 1, 2, 4, 8]
/// [wide, narrow] (see [`gemv_outputs_per_warp`]).
struct GemvKernels([[[[CudaFunction; 2]; 4]; 3]; 5]);

impl GemvKernels {
    fn new(gpu: &Gpu) -> Result<Self> {
        let f = |output: &str, kind: &str, r: &str| gpu.function(&SOURCE, &format!("tern_gemv_{output}{kind}_{r}"));
        let by_type = |output: &str| -> Result<[[[CudaFunction; 2]; 4]; 3]> {
            let rows = |kind: &str| -> Result<[[CudaFunction; 2]; 4]> {
                Ok([
                    [f(output, kind, "1")?, f(output, kind, "1")?],
                    [f(output, kind, "2")?, f(output, kind, "2n")?],
                    [f(output, kind, "4")?, f(output, kind, "4n")?],
                    [f(output, kind, "8")?, f(output, kind, "8n")?],
                ])
            };
            Ok([rows("f32")?, rows("bf16")?, rows("q8")?])
        };
        Ok(GemvKernels([by_type("")?, by_type("silu_")?, by_type("gelu_")?, by_type("res_")?, by_type("addnorm_")?]))
    }

    fn get(&self, output: GemvOutput, w: &GpuMatrix, rows: usize, narrow: bool) -> &CudaFunction {
        let r = match rows {
            1 => 0,
            2 => 1,
            3 | 4 => 2,
            _ => 3,
        };
        &self.0[output.index()][w.kind()][r][narrow as usize]
    }
}

/// Output features each warp of a GEMV computes for `rows` rows of x (the kernels' OPW and
/// OPW_GATED; one in the narrow forms): one for a single row; for more, several, so that each
/// x value loaded serves several weight rows. A gated feature holds two weight rows (gate and
/// up), so half as many. (Two for a single row measured a wash on the H200: the 5–8k-feature
/// products 0.1–0.5 µs faster, the 248 320-row head 6–10 µs slower; a Q8_0 head is the
/// exception, with its own kernel: [`Q8_PAIRED_MIN_FEATURES`].) A launch whose wide form
/// would leave multiprocessors idle (small matrices: an embedding model's few-token query)
/// takes the narrow form instead.
fn gemv_outputs_per_warp(rows: usize, output: GemvOutput, narrow: bool) -> usize {
    let plain = match rows {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    };
    match (narrow, output.gated()) {
        (true, _) => 1,
        (false, false) => plain,
        (false, true) => (plain / 2).max(1),
    }
}

/// The k splits of a `tern_gemm_q8` product: enough blocks for [`GEMM_Q8_BLOCKS_PER_SM`] a
/// multiprocessor, each split at least two stages of k, at most 16 parts.
fn gemm_q8_splits(out: usize, rows: usize, inp: usize, multiprocessors: usize) -> usize {
    let (bm, bn, kc, _) = GEMM_Q8_TILE;
    let blocks = out.div_ceil(bm) * rows.div_ceil(bn);
    let want = (GEMM_Q8_BLOCKS_PER_SM * multiprocessors).div_ceil(blocks);
    want.min(inp.div_ceil(kc) / 2).clamp(1, 16)
}

/// Warps per output feature of a GEMV launch over `features` features (all its matrices) of
/// `inp` inputs (the kernels' ks, see gemv.cu): a launch of few features takes more warps per
/// row, until the launch has [`GEMV_SPLIT_WARPS`] warps per multiprocessor, each keeping at
/// least two of its row's warp steps ([`GEMV_STEP_WEIGHTS`]). A function of the launch's
/// matrices and the GPU, never of the rows of x: a row's result is the same alone and in a
/// batch.
fn gemv_split(features: usize, inp: usize, multiprocessors: usize) -> usize {
    let mut ks = 1;
    while 2 * ks <= GEMV_WARPS && features * ks < GEMV_SPLIT_WARPS * multiprocessors && inp >= 2 * GEMV_STEP_WEIGHTS * (2 * ks) {
        ks *= 2;
    }
    ks
}

/// The fewest warps per output feature that leave each warp of a one-row launch no more
/// steps than it requests before its wait (`early_steps`: W::EARLY_STEPS in gemv.cu, 2 for
/// f32 weights, 4 for bf16 and Q8_0): a split beyond it adds blocks, whose early requests
/// then no longer fit on the multiprocessors beside the kernel before (Qwen3.5-0.8B's gate|up
/// product in 896 blocks of 64 registers, 4 a multiprocessor: 528 at once), without adding a
/// byte in flight. A function of the matrix's width and weight type only, like
/// [`gemv_split`]: a row's result stays the same alone and in a batch.
fn gemv_split_filling_early(inp: usize, early_steps: usize) -> usize {
    debug_assert!(early_steps > 0);
    let mut ks = 1;
    while ks < GEMV_WARPS && inp > early_steps * GEMV_STEP_WEIGHTS * ks {
        ks *= 2;
    }
    ks
}

/// W::EARLY_STEPS of gemv.cu's weight types [f32, bf16, Q8_0] (a test reads them there).
const GEMV_EARLY_STEPS: [usize; 3] = [2, 4, 4];

/// Tiles (expert, first row, rows) of at most [`GEMV_MAX_ROWS`] rows covering rows sorted by
/// expert, `start[e] .. start[e + 1]` being expert e's rows ([`Blas::tiles`]).
pub fn expert_tiles(start: &[usize]) -> Result<Vec<[i32; 3]>> {
    let mut tiles = Vec::new();
    for (e, w) in start.windows(2).enumerate() {
        for r0 in (w[0]..w[1]).step_by(GEMV_MAX_ROWS) {
            let n = (w[1] - r0).min(GEMV_MAX_ROWS);
            tiles.push([int_arg("tile expert", e)?, int_arg("tile row", r0)?, n as i32]);
        }
    }
    Ok(tiles)
}

/// Weights of a row one GEMV warp step takes: 32 lanes × the kernels' STEP, 8 weights a lane
/// for every stored type (gemv.cu).
const GEMV_STEP_WEIGHTS: usize = 32 * 8;

/// Conv widths a one-row GEMV applies to its outputs ([`Blas::linears_conv`]; Qwen3.5's is 4),
/// one kernel each (gemv.cu's TERN_GEMV_CONV_KERNELS); other widths run the conv kernel.
const CONV_KERNEL_WIDTHS: [usize; 3] = [2, 3, 4];

/// Rows up to which a product fuses the norm after it (see [`Blas::norm_tail_fits`]).
pub const NORM_TAIL_MAX_ROWS: usize = 1;

/// The widest stream whose norm a one-row GEMV forms in its blocks ([`Blas::linear_residual_norm_then`]):
/// TERN_NORM_TAIL_SLOTS values a thread of a block of 256 (gemv.cu).
pub const NORMED_MAX: usize = 8 * 32 * GEMV_WARPS;

/// Features from which a one-row Q8_0 product takes two features a warp (`tern_gemv_q8_1x2`):
/// the vocabulary head (Qwen3.5's 248 320 rows), whose one-feature warps each hold a
/// 1024-weight row of quants, 1 KiB, too few bytes in flight for the blocks' turnover.
pub const Q8_PAIRED_MIN_FEATURES: usize = 65_536;

/// Warps per multiprocessor a split GEMV launch aims at (a full one holds 64; 32 with their
/// loads in flight cover the memory latency, measured on the H200).
const GEMV_SPLIT_WARPS: usize = 32;

/// The operands of the norm a GEMV's last block forms (the norm_w .. post fields of
/// `tern_gemv_parts`; zero for the other outputs).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct NormTail {
    norm_w: u64,
    norm_out: u64,
    counter: u64,
    eps: f32,
    stream: u64,
    next_w: u64,
    post: f32,
}

/// A cuBLAS handle on the GPU's stream, and the helper kernels.
pub struct Blas {
    gpu: Arc<Gpu>,
    handle: CudaBlas,
    /// The handle's workspace, [`BLAS_WORKSPACE_BYTES`], set once (dropped after the handle).
    /// Without one, cuBLAS (12.2 on) takes its workspace with cudaMallocAsync at each product
    /// on a capturing stream: a recorded round of many sequences then holds a memory node per
    /// GEMM, each a full edge in its graph, and keeps that memory per graph.
    _workspace: CudaSlice<u8>,
    /// GEMM operands in bf16 (the fast mode); f32 weights are rounded to bf16 at upload.
    tensor_cores: bool,
    to_bf16: CudaFunction,
    add_bias: CudaFunction,
    gemv: GemvKernels,
    /// Multiprocessors of the device (the GEMV's choice of form).
    multiprocessors: usize,
    /// Products of at most this many rows take the GEMV: [`GEMV_MAX_ROWS`], or fewer where
    /// TERN_GEMV_MAX_ROWS says so (to measure the GEMV against cuBLAS on the same run).
    gemv_max_rows: usize,
    /// Whether few-feature matrices split each row over several warps (see [`gemv_split`]);
    /// TERN_GEMV_SPLIT=0 turns it off, to measure the two forms on the same run.
    gemv_split: bool,
    /// Whether the split is bounded by [`gemv_split_filling_early`] (the default;
    /// TERN_GEMV_SPLIT_EARLY=0 declines, to measure the two on the same run). H100, Qwen3.5-0.8B
    /// bf16 decode of one sequence, two pairs in one call: 1 057.1 -> 1 094.0 and 1 054.1 ->
    /// 1 069.6 tok/s; after 512 tokens 1 005.3 -> 1 037.4 and 1 011.8 -> 1 031.0 (BENCHMARKS.md,
    /// twenty-third session).
    gemv_split_early: bool,
    /// Whether one-row products request their first weights before awaiting the kernel before
    /// them (`early` in gemv.cu): under dependent launch (a decode step's launches by
    /// default, `DependentLaunch` in cuda/mod.rs) the step's next product then has its first
    /// weights in flight while the kernel before it still runs. Safe because no kernel writes
    /// a weight matrix (they are uploaded by copies, [`Blas::matrix`]). On where dependent
    /// launch can be (without it the order changes nothing); TERN_GEMV_EARLY=0 turns it off, to
    /// measure the two on the same run. The same bits either way. H100, Qwen3.5-0.8B bf16
    /// decode: 896 -> 923 tok/s (BENCHMARKS.md, 2026-12-05).
    gemv_early: bool,
    /// Whether [`Blas::linear_residual_norm_then`] and [`Blas::linear_residual_norm_conv`] form
    /// the norm in the next product's blocks (the default) or decline, so that the caller runs
    /// the product ending in the norm, then the next one (TERN_GEMV_NORMED=0, to measure the
    /// two on the same run). The same bits either way. H100, Qwen3.5-0.8B decode, tails ->
    /// normed in the same call: bf16 903.9 -> 928.1 and 909.3 -> 933.9 tok/s, Q8_0 level
    /// (1 037.8 / 1 035.7) (BENCHMARKS.md, 2026-12-05, twentieth session).
    gemv_normed: bool,
    /// `tern_gemv_{,silu_,gelu_}{f32,bf16,q8}_1_normed`: the one-row products that form their
    /// input's norm ([`Blas::linear_residual_norm_then`]),
    /// kernels of their own so that the others keep their registers and global loads: [plain,
    /// silu, gelu][weight type].
    normed_kernels: [[CudaFunction; 3]; 3],
    /// Whether one-row Q8_0 products of many features take [`Blas::q8_paired_kernel`];
    /// TERN_GEMV_Q8_PAIRED=0 turns it off, to measure the two forms on the same run.
    q8_paired: bool,
    /// `tern_gemv_q8_1x2`: a one-row Q8_0 product, two features a warp.
    q8_paired_kernel: CudaFunction,
    /// `tern_gemv_conv_{f32,bf16,q8}_1_k{K}`: one-row plain products with a conv part
    /// ([`Blas::linears_conv`]), by conv width ([`CONV_KERNEL_WIDTHS`]) and weight type.
    conv_kernels: Vec<[CudaFunction; 3]>,
    /// `tern_gemv_conv_{f32,bf16,q8}_1_k{K}_normed`: the same forming their input's norm
    /// ([`Blas::linear_residual_norm_conv`]).
    conv_normed_kernels: Vec<[CudaFunction; 3]>,
    /// Whether fast mode's products of several rows with bf16 weights take the tensor-core
    /// GEMV ([`Blas::gemv_mma_fits`]); TERN_GEMV_MMA=0 turns it off, to measure the two forms
    /// on the same run.
    gemv_mma: bool,
    /// Whether Q8_0 weights take the tensor-core GEMV too (TERN_GEMV_MMA_Q8=0 turns it off, to
    /// measure the two forms on the same run). H200, Qwen3.5-35B-A3B's 8 layers as Q8_0, fast
    /// mode, on / off: prompts of 16, 128, 512 tokens 2 880 / 2 375, 14 350 / 7 689,
    /// 29 935 / 11 289 tokens/s; decode rounds of 8 sequences 4 374 / 3 428.
    gemv_mma_q8: bool,
    /// Fast mode's plain products of Q8_0 weights for more rows than [`GEMV_MAX_ROWS`], up to
    /// this many, on the tensor-core GEMV in tiles of 8 rows ([`Blas::linear`]) rather than a
    /// GEMM of the matrix expanded to bf16 at every product: [outside, inside a decode step],
    /// [`MMA_ROW_TILES_MAX_ROWS`], or TERN_GEMV_MMA_ROWS and TERN_GEMV_MMA_STEP_ROWS (0: none,
    /// to measure the two on the same run).
    mma_rows_max: [usize; 2],
    /// `tern_gemm_q8` and the sum of its k splits, taken for rows up to `gemm_q8_rows_max`
    /// ([`Blas::gemm_q8_fits`]).
    gemm_q8: CudaFunction,
    gemm_q8_sum: CudaFunction,
    gemm_q8_rows_max: usize,
    /// The tensor-core GEMV: [bf16, Q8_0 weights][plain, silu-gated, gelu-gated output].
    mma_kernels: [[CudaFunction; 3]; 2],
    /// The same with four steps' loads in flight (`tern_gemv_mma_ahead_*`), taken when
    /// `gemv_mma_ahead` is on (the default; TERN_GEMV_MMA_AHEAD=0 keeps one step's, the same
    /// bits). With the register norms, an 8-token EmbeddingGemma 2 query on the H200 takes
    /// 0.858 ms against 1.155 (bf16 mode).
    mma_ahead_kernels: [[CudaFunction; 3]; 2],
    gemv_mma_ahead: bool,
    /// The tensor-core GEMV whose gelu multiplies another tensor's view
    /// ([`Blas::linear_gelu_by`]): [one step, four ahead][bf16, Q8_0 weights].
    mma_gelu_by: [[CudaFunction; 2]; 2],
    /// The tensor-core GEMV over tiles of expert rows: [bf16, Q8_0 weights][plain, silu-gated].
    mma_tiles: [[CudaFunction; 2]; 2],
    /// The same over a tile list made on the device ([`Blas::tiles_counted`]).
    mma_tiles_counted: [[CudaFunction; 2]; 2],
    /// The arrival counter of the blocks of a GEMV ending in a norm (zero between launches;
    /// launches on the one stream never overlap).
    residual_counter: CudaSlice<u32>,
    /// The routed GEMV: [plain, silu-gated output][f32, bf16, Q8_0].
    routed: [[CudaFunction; 3]; 2],
    /// Expert products over tiles of a few rows sorted by expert: [plain, silu-gated output]
    /// [f32, bf16, Q8_0] ([`Blas::tiles`]).
    tiles: [[CudaFunction; 3]; 2],
    /// The same over a tile list made on the device ([`Blas::tiles_counted`]).
    tiles_counted: [[CudaFunction; 3]; 2],
    /// The routed down products, their weighted sum, the residual step and the norm in one
    /// launch: [f32, bf16, Q8_0] ([`Blas::routed_residual_norm`]).
    routed_residual: [CudaFunction; 3],
    expand_bf16_f32: CudaFunction,
    expand_q8_f32: CudaFunction,
    expand_q8_bf16: CudaFunction,
    /// `tern_expand_q8_bf16_many`: many Q8_0 matrices' expansion in one launch.
    expand_q8_bf16_many: CudaFunction,
}

/// The matrices of a launch's parts.
fn matrices<'m>(parts: &[(&'m GpuMatrix, &mut CudaSlice<f32>)]) -> Vec<&'m GpuMatrix> {
    parts.iter().map(|(w, _)| *w).collect()
}

/// The cuBLAS handle's workspace: 32 MiB, what cuBLAS documents for Hopper (4 MiB elsewhere).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

fn blas_err(what: &str) -> impl FnOnce(cudarc::cublas::result::CublasError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e:?}"))
}

/// Q8_0 blocks (an f16 scale, then 32 i8 quants) split into the quants and the scales.
fn split_q8_0(blocks: &[u8]) -> (Vec<i8>, Vec<u16>) {
    let n = blocks.len() / BLOCK_BYTES;
    let (mut quants, mut scales) = (Vec::with_capacity(n * BLOCK), Vec::with_capacity(n));
    for b in blocks.chunks_exact(BLOCK_BYTES) {
        scales.push(u16::from_le_bytes([b[0], b[1]]));
        quants.extend(b[2..].iter().map(|&q| q as i8));
    }
    (quants, scales)
}

impl Blas {
    pub fn new(gpu: Arc<Gpu>, tensor_cores: bool) -> Result<Self> {
        cublas_available()?;
        let handle = CudaBlas::new(gpu.stream().clone()).map_err(blas_err("creating the cuBLAS handle"))?;
        let workspace = gpu.alloc::<u8>(BLAS_WORKSPACE_BYTES)?;
        // SAFETY: the handle is live and the buffer lives as long as it (a field of the same
        // struct, dropped after the handle); the handle's products run on the GPU's one stream,
        // so no two of them use the workspace at once.
        unsafe { blas_sys::cublasSetWorkspace_v2(*handle.handle(), gpu.ptr(&workspace) as *mut std::ffi::c_void, BLAS_WORKSPACE_BYTES) }
            .result()
            .map_err(blas_err("setting the cuBLAS workspace"))?;
        let f = |name: &str| gpu.function(&SOURCE, name);
        Ok(Blas {
            to_bf16: f("tern_to_bf16")?,
            add_bias: f("tern_add_bias")?,
            gemv: GemvKernels::new(&gpu)?,
            multiprocessors: gpu.multiprocessors()?,
            gemv_max_rows: std::env::var("TERN_GEMV_MAX_ROWS").ok().and_then(|v| v.parse().ok()).map_or(GEMV_MAX_ROWS, |n: usize| n.min(GEMV_MAX_ROWS)),
            gemv_split: std::env::var("TERN_GEMV_SPLIT").map_or(true, |v| v != "0"),
            gemv_split_early: std::env::var("TERN_GEMV_SPLIT_EARLY").map_or(true, |v| v != "0"),
            q8_paired: std::env::var("TERN_GEMV_Q8_PAIRED").map_or(true, |v| v != "0"),
            gemv_early: gpu.dependent_launch() && std::env::var("TERN_GEMV_EARLY").map_or(true, |v| v != "0"),
            gemv_normed: std::env::var("TERN_GEMV_NORMED").map_or(true, |v| v != "0"),
            normed_kernels: [
                [f("tern_gemv_f32_1_normed")?, f("tern_gemv_bf16_1_normed")?, f("tern_gemv_q8_1_normed")?],
                [f("tern_gemv_silu_f32_1_normed")?, f("tern_gemv_silu_bf16_1_normed")?, f("tern_gemv_silu_q8_1_normed")?],
                [f("tern_gemv_gelu_f32_1_normed")?, f("tern_gemv_gelu_bf16_1_normed")?, f("tern_gemv_gelu_q8_1_normed")?],
            ],
            q8_paired_kernel: f("tern_gemv_q8_1x2")?,
            conv_kernels: CONV_KERNEL_WIDTHS
                .iter()
                .map(|k| Ok([f(&format!("tern_gemv_conv_f32_1_k{k}"))?, f(&format!("tern_gemv_conv_bf16_1_k{k}"))?, f(&format!("tern_gemv_conv_q8_1_k{k}"))?]))
                .collect::<Result<_>>()?,
            conv_normed_kernels: CONV_KERNEL_WIDTHS
                .iter()
                .map(|k| {
                    let name = |kind: &str| format!("tern_gemv_conv_{kind}_1_k{k}_normed");
                    Ok([f(&name("f32"))?, f(&name("bf16"))?, f(&name("q8"))?])
                })
                .collect::<Result<_>>()?,
            gemv_mma: std::env::var("TERN_GEMV_MMA").map_or(true, |v| v != "0"),
            gemv_mma_q8: std::env::var("TERN_GEMV_MMA_Q8").map_or(true, |v| v != "0"),
            mma_rows_max: [("TERN_GEMV_MMA_ROWS", MMA_ROW_TILES_MAX_ROWS[0]), ("TERN_GEMV_MMA_STEP_ROWS", MMA_ROW_TILES_MAX_ROWS[1])]
                .map(|(var, default)| std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)),
            gemm_q8: {
                let k = f("tern_gemm_q8")?;
                k.set_attribute(MAX_DYN_SMEM, GEMM_Q8_SMEM_BYTES as i32).map_err(driver_err("allowing tern_gemm_q8's shared memory"))?;
                k
            },
            gemm_q8_sum: f("tern_gemm_q8_sum")?,
            gemm_q8_rows_max: std::env::var("TERN_GEMM_Q8_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(GEMM_Q8_MAX_ROWS),
            mma_kernels: [
                [f("tern_gemv_mma_bf16")?, f("tern_gemv_mma_silu_bf16")?, f("tern_gemv_mma_gelu_bf16")?],
                [f("tern_gemv_mma_q8")?, f("tern_gemv_mma_silu_q8")?, f("tern_gemv_mma_gelu_q8")?],
            ],
            mma_ahead_kernels: [
                [f("tern_gemv_mma_ahead_bf16")?, f("tern_gemv_mma_ahead_silu_bf16")?, f("tern_gemv_mma_ahead_gelu_bf16")?],
                [f("tern_gemv_mma_ahead_q8")?, f("tern_gemv_mma_ahead_silu_q8")?, f("tern_gemv_mma_ahead_gelu_q8")?],
            ],
            gemv_mma_ahead: std::env::var("TERN_GEMV_MMA_AHEAD").map_or(true, |v| v != "0"),
            mma_gelu_by: [
                [f("tern_gemv_mma_gelu_by_bf16")?, f("tern_gemv_mma_gelu_by_q8")?],
                [f("tern_gemv_mma_ahead_gelu_by_bf16")?, f("tern_gemv_mma_ahead_gelu_by_q8")?],
            ],
            mma_tiles: [
                [f("tern_gemv_mma_tiles_bf16")?, f("tern_gemv_mma_tiles_silu_bf16")?],
                [f("tern_gemv_mma_tiles_q8")?, f("tern_gemv_mma_tiles_silu_q8")?],
            ],
            mma_tiles_counted: [
                [f("tern_gemv_mma_tiles_bf16_counted")?, f("tern_gemv_mma_tiles_silu_bf16_counted")?],
                [f("tern_gemv_mma_tiles_q8_counted")?, f("tern_gemv_mma_tiles_silu_q8_counted")?],
            ],
            residual_counter: gpu.zeros::<u32>(1)?,
            routed: [
                [f("tern_gemv_routed_f32")?, f("tern_gemv_routed_bf16")?, f("tern_gemv_routed_q8")?],
                [f("tern_gemv_routed_silu_f32")?, f("tern_gemv_routed_silu_bf16")?, f("tern_gemv_routed_silu_q8")?],
            ],
            tiles: [
                [f("tern_gemv_tiles_f32")?, f("tern_gemv_tiles_bf16")?, f("tern_gemv_tiles_q8")?],
                [f("tern_gemv_tiles_silu_f32")?, f("tern_gemv_tiles_silu_bf16")?, f("tern_gemv_tiles_silu_q8")?],
            ],
            tiles_counted: [
                [f("tern_gemv_tiles_f32_counted")?, f("tern_gemv_tiles_bf16_counted")?, f("tern_gemv_tiles_q8_counted")?],
                [f("tern_gemv_tiles_silu_f32_counted")?, f("tern_gemv_tiles_silu_bf16_counted")?, f("tern_gemv_tiles_silu_q8_counted")?],
            ],
            routed_residual: [f("tern_gemv_routed_res_f32")?, f("tern_gemv_routed_res_bf16")?, f("tern_gemv_routed_res_q8")?],
            expand_bf16_f32: f("tern_expand_bf16_f32")?,
            expand_q8_f32: f("tern_expand_q8_f32")?,
            expand_q8_bf16: f("tern_expand_q8_bf16")?,
            expand_q8_bf16_many: f("tern_expand_q8_bf16_many")?,
            tensor_cores,
            handle,
            _workspace: workspace,
            gpu,
        })
    }

    /// Uploads a weight matrix [out][in] in its stored type; f32 weights become bf16 in the
    /// fast mode.
    pub fn matrix(&self, w: &Weights, out: usize, inp: usize) -> Result<GpuMatrix> {
        check_len("matrix", w.len(), out * inp)?;
        let g = &self.gpu;
        let w = match *w {
            Weights::F32(v) if self.tensor_cores => {
                let bits: Vec<u16> = v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                GpuWeights::Bf16(g.upload(&bits)?)
            }
            Weights::F32(v) => GpuWeights::F32(g.upload(v)?),
            Weights::Bf16(v) => GpuWeights::Bf16(g.upload(v)?),
            Weights::Q8_0(blocks) => {
                if inp % BLOCK != 0 {
                    return Err(Error::Shape(format!("Q8_0 rows of {inp} columns are not whole blocks of {BLOCK}")));
                }
                let (quants, scales) = split_q8_0(blocks);
                GpuWeights::Q8 { quants: g.upload(&quants)?, scales: g.upload(&scales)? }
            }
        };
        Ok(GpuMatrix { w, out, inp })
    }

    /// Matrices of `inp` columns stacked by rows into one ([Σ out][in]): in their common stored
    /// type, or as f32 when they differ.
    pub fn stacked(&self, parts: &[Weights], inp: usize) -> Result<GpuMatrix> {
        let out = parts.iter().map(|p| p.len() / inp.max(1)).sum::<usize>();
        let same = |f: fn(&Weights) -> bool| parts.iter().all(f);
        if same(|p| matches!(p, Weights::F32(_))) || same(|p| matches!(p, Weights::Bf16(_))) || same(|p| matches!(p, Weights::Q8_0(_))) {
            return match parts.first() {
                Some(Weights::F32(_)) => {
                    let all: Vec<f32> = parts.iter().flat_map(|p| if let Weights::F32(v) = p { v.to_vec() } else { Vec::new() }).collect();
                    self.matrix(&Weights::F32(&all), out, inp)
                }
                Some(Weights::Bf16(_)) => {
                    let all: Vec<u16> = parts.iter().flat_map(|p| if let Weights::Bf16(v) = p { v.to_vec() } else { Vec::new() }).collect();
                    self.matrix(&Weights::Bf16(&all), out, inp)
                }
                Some(Weights::Q8_0(_)) => {
                    let all: Vec<u8> = parts.iter().flat_map(|p| if let Weights::Q8_0(v) = p { v.to_vec() } else { Vec::new() }).collect();
                    self.matrix(&Weights::Q8_0(&all), out, inp)
                }
                None => Err(Error::Shape("nothing to stack".into())),
            };
        }
        let mut all = Vec::with_capacity(out * inp);
        for p in parts {
            all.extend(p.to_f32(inp)?);
        }
        self.matrix(&Weights::F32(&all), out, inp)
    }

/// y = bf16(x), elementwise. CPU twin: `half::bf16::from_f32`.
    pub fn to_bf16(&self, x: &CudaSlice<f32>, y: &mut CudaSlice<u16>) -> Result<()> {
        check_len("to_bf16 output", y.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let (xp, yp, n) = (g.ptr(x), g.ptr(y), x.len() as u64);
        let mut l = g.launch_builder(&self.to_bf16);
        l.arg(&xp).arg(&n).arg(&yp);
        // Eight values a thread (the kernel's step).
        let cfg = LaunchConfig { grid_dim: (grid_for(x.len().div_ceil(8), 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; both buffers hold n elements and are whole allocations
        // (16-byte aligned, as the kernel's vector accesses need).
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
        let mut l = g.launch_builder(&self.add_bias);
        l.arg(&yp).arg(&bp).arg(&rows).arg(&d);
        let cfg = LaunchConfig { grid_dim: (grid_for(y.len(), 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; y holds rows × d.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_add_bias"))?;
        Ok(())
    }

    /// Y = X·Wᵀ for `rows` rows of f32 X. CPU twin: [`super::linear_w`].
    pub fn linear(&self, x: &CudaSlice<f32>, rows: usize, w: &GpuMatrix, y: &mut CudaSlice<f32>) -> Result<()> {
        check_len("linear input", x.len(), rows * w.inp)?;
        check_len("linear output", y.len(), rows * w.out)?;
        if rows == 0 || w.out == 0 {
            return Ok(());
        }
        if self.gemv_fits(rows, w) {
            return self.gemv(x, GemvOutput::Plain, rows, &mut [(w, y)]);
        }
        if self.mma_row_tiles(rows, w) {
            let (r, inp) = (int_arg("gemv rows", rows)?, int_arg("gemv in", w.inp)?);
            return self.gemv_mma(x, GemvOutput::Plain, r, inp, &mut [(w, y)], None);
        }
        let g = &self.gpu;
        let n = w.out * w.inp;
        let f32_operands = |wp: u64| (wp, blas_sys::cudaDataType_t::CUDA_R_32F, g.ptr(x), blas_sys::cudaDataType_t::CUDA_R_32F);
        // Scratch operands live until the product is queued (the stream orders their reuse).
        let (mut w32, mut x16) = (None, None);
        let operands = match (&w.w, self.tensor_cores) {
            (GpuWeights::F32(wd), _) => f32_operands(g.ptr(wd)),
            (GpuWeights::Bf16(wd), false) => {
                let e = w32.insert(g.alloc::<f32>(n)?);
                self.expand(&self.expand_bf16_f32, &[g.ptr(wd)], n, g.ptr(e))?;
                f32_operands(g.ptr(e))
            }
            (GpuWeights::Q8 { quants, scales }, false) => {
                let e = w32.insert(g.alloc::<f32>(n)?);
                self.expand(&self.expand_q8_f32, &[g.ptr(quants), g.ptr(scales)], n, g.ptr(e))?;
                f32_operands(g.ptr(e))
            }
            (_, true) => {
                let xb = x16.insert(g.alloc::<u16>(x.len())?);
                self.to_bf16(x, xb)?;
                return self.product_of_bf16_rows(g.ptr(xb), rows, w, y);
            }
        };
        self.gemm(operands, rows, w, g.ptr(y))
    }

    /// Whether [`Blas::linear`] of `rows` rows through `w` rounds its input rows to bf16 for
    /// the tensor cores (fast mode, bf16 or Q8_0 weights, too many rows for the GEMV): then a
    /// producer may write its rows as bf16 and hand them to [`Blas::linear_bf16`], sparing the
    /// f32 rows' write and the conversion pass's read.
    pub fn takes_bf16_rows(&self, rows: usize, w: &GpuMatrix) -> bool {
        self.tensor_cores && !matches!(w.w, GpuWeights::F32(_)) && !self.gemv_fits(rows, w) && !self.mma_row_tiles(rows, w)
    }

    /// Whether [`Blas::linear`] of `rows` rows through `w` runs on the tensor-core GEMV in tiles
    /// of [`GEMV_MAX_ROWS`] rows: fast mode, Q8_0 weights it takes, more rows than the GEMV's
    /// and at most `mma_rows_max`'s bound for where the product runs (Q8_0 weights would
    /// otherwise be expanded to bf16 for a GEMM at every product; bf16 weights go to the GEMM as
    /// stored). A decode step's plain run and its recording take the same bound, so the same
    /// path and bits.
    fn mma_row_tiles(&self, rows: usize, w: &GpuMatrix) -> bool {
        let bound = self.mma_rows_max[usize::from(self.gpu.in_decode_step())];
        rows > GEMV_MAX_ROWS && rows <= bound && w.kind() == KIND_Q8 && self.mma_kind(KIND_Q8).is_some() && w.inp % 32 == 0
    }

    /// [`Blas::linear`] from rows already rounded to bf16, as its tensor-core path rounds f32
    /// rows ([`Blas::takes_bf16_rows`] must hold): the same product, so the same bits as
    /// [`Blas::linear`] of the f32 rows those bf16 rows were rounded from.
    pub fn linear_bf16(&self, x16: &CudaSlice<u16>, rows: usize, w: &GpuMatrix, y: &mut CudaSlice<f32>) -> Result<()> {
        check_len("linear input", x16.len(), rows * w.inp)?;
        check_len("linear output", y.len(), rows * w.out)?;
        if !self.takes_bf16_rows(rows, w) {
            return Err(Error::Shape(format!("linear of bf16 rows: {rows} rows through a {}×{} matrix do not take the tensor-core product", w.out, w.inp)));
        }
        if rows == 0 || w.out == 0 {
            return Ok(());
        }
        self.product_of_bf16_rows(self.gpu.ptr(x16), rows, w, y)
    }

    /// Y = X·Wᵀ for `rows` bf16 rows at `x16` on the tensor cores ([`Blas::linear`]'s fast path
    /// past the GEMV, and [`Blas::linear_bf16`]): `tern_gemm_q8` where it takes the product, else
    /// cuBLAS's GEMM of the weights as bf16 (Q8_0 expanded into scratch that lives until the
    /// product is queued).
    fn product_of_bf16_rows(&self, x16: u64, rows: usize, w: &GpuMatrix, y: &mut CudaSlice<f32>) -> Result<()> {
        if self.gemm_q8_fits(rows, w) {
            return self.gemm_q8(x16, rows, w, y);
        }
        let mut w16 = None;
        let wp = self.bf16_weights(w, &mut w16)?;
        let bf16 = blas_sys::cudaDataType_t::CUDA_R_16BF;
        self.gemm((wp, bf16, x16, bf16), rows, w, self.gpu.ptr(y))
    }

    /// The bf16 operand of a tensor-core product through `w`: its own bf16 weights, or Q8_0
    /// weights expanded into `scratch` (which lives until the product is queued).
    fn bf16_weights(&self, w: &GpuMatrix, scratch: &mut Option<CudaSlice<u16>>) -> Result<u64> {
        let g = &self.gpu;
        match &w.w {
            GpuWeights::Q8 { quants, scales } => {
                let n = w.out * w.inp;
                let e = scratch.insert(g.alloc::<u16>(n)?);
                self.expand(&self.expand_q8_bf16, &[g.ptr(quants), g.ptr(scales)], n, g.ptr(e))?;
                Ok(g.ptr(e))
            }
            GpuWeights::Bf16(wd) => Ok(g.ptr(wd)),
            GpuWeights::F32(_) => Err(Error::Shape("a tensor-core product of f32 weights".into())),
        }
    }

    /// Y[r0 .. r0 + n] = X[r0 .. r0 + n]·W_gᵀ for each group (W_g, r0, n) of the rows of one X
    /// ([rows][in]) into one Y ([rows][out]): a mixture-of-experts layer's products over its
    /// rows sorted by expert, each expert's weights read once for all its rows. The matrices
    /// share one shape and storage type. X is rounded to bf16 once (fast mode), and stored
    /// weights the product cannot take as they are are expanded into scratch that the groups
    /// reuse in stream order: one expert at a time, or for Q8_0 in fast mode a chunk of experts
    /// per launch. CPU twin: [`super::linear_w`] of each group's rows.
    pub fn grouped_linear(&self, x: &CudaSlice<f32>, groups: &[(&GpuMatrix, usize, usize)], y: &mut CudaSlice<f32>) -> Result<()> {
        let Some(&(first, ..)) = groups.first() else { return Ok(()) };
        let (out, inp) = (first.out, first.inp);
        if inp == 0 || x.len() % inp != 0 {
            return Err(Error::Shape(format!("grouped linear: {} inputs are not rows of {inp}", x.len())));
        }
        let rows = x.len() / inp;
        check_len("grouped linear output", y.len(), rows * out)?;
        let kind = |w: &GpuWeights| std::mem::discriminant(w);
        for &(w, r0, n) in groups {
            if w.out != out || w.inp != inp || kind(&w.w) != kind(&first.w) || r0 + n > rows {
                return Err(Error::Shape(format!(
                    "grouped linear: rows {r0}..{} of {rows} with a {}×{} matrix among {out}×{inp} ones of one type",
                    r0 + n,
                    w.out,
                    w.inp
                )));
            }
        }
        if out == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let n_w = out * inp;
        let bf16 = self.tensor_cores && !matches!(first.w, GpuWeights::F32(_));
        // Scratch operands live until the last product is queued (the stream orders their reuse).
        let mut x16 = None;
        let (xp, x_type, x_bytes) = if bf16 {
            let xb = x16.insert(g.alloc::<u16>(x.len())?);
            self.to_bf16(x, xb)?;
            (g.ptr(xb), blas_sys::cudaDataType_t::CUDA_R_16BF, 2)
        } else {
            (g.ptr(x), blas_sys::cudaDataType_t::CUDA_R_32F, 4)
        };
        let yp = g.ptr(y);
        let product = |w: &GpuMatrix, wp: u64, w_type, r0: usize, n: usize| {
            self.gemm((wp, w_type, xp + (r0 * inp * x_bytes) as u64, x_type), n, w, yp + (r0 * out * 4) as u64)
        };
        if bf16 && matches!(first.w, GpuWeights::Q8 { .. }) {
            // Q8_0 experts in fast mode: a chunk of the experts that have rows expanded to bf16
            // in one launch (scratch of at most EXPAND_CHUNK_BYTES), then their products.
            let busy: Vec<&(&GpuMatrix, usize, usize)> = groups.iter().filter(|gr| gr.2 > 0).collect();
            let per_chunk = (EXPAND_CHUNK_BYTES / (2 * n_w)).clamp(1, 65_535);
            let scratch = g.alloc::<u16>(per_chunk.min(busy.len()) * n_w)?;
            let mut tables = Vec::new();
            for chunk in busy.chunks(per_chunk) {
                let (quants, scales): (Vec<u64>, Vec<u64>) = chunk.iter().map(|gr| gr.0.pointers(g)).unzip();
                let (qt, st) = (g.upload(&quants)?, g.upload(&scales)?);
                let (qp, sp, dp, count) = (g.ptr(&qt), g.ptr(&st), g.ptr(&scratch), n_w as u64);
                let mut l = g.launch_builder(&self.expand_q8_bf16_many);
                l.arg(&qp).arg(&sp).arg(&count).arg(&dp);
                let cfg = LaunchConfig { grid_dim: (grid_for(n_w / 8, 256)?.min(4096), chunk.len() as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: argument types match tern_expand_q8_bf16_many; each table entry is a
                // Q8_0 matrix of n_w weights (n_w % 32 == 0: whole blocks, so the quants' 8-byte
                // and the output's 16-byte accesses stay aligned) and the scratch holds
                // chunk.len() × n_w outputs.
                unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_expand_q8_bf16_many"))?;
                for (i, &&(w, r0, n)) in chunk.iter().enumerate() {
                    product(w, g.ptr(&scratch) + (2 * i * n_w) as u64, blas_sys::cudaDataType_t::CUDA_R_16BF, r0, n)?;
                }
                // The tables live until the stream has read them (freed after the last product).
                tables.push((qt, st));
            }
            return Ok(());
        }
        let mut w32 = None;
        for &(w, r0, n) in groups {
            if n == 0 {
                continue;
            }
            let (wp, w_type) = match (&w.w, bf16) {
                (GpuWeights::F32(wd), _) => (g.ptr(wd), blas_sys::cudaDataType_t::CUDA_R_32F),
                (GpuWeights::Bf16(wd), true) => (g.ptr(wd), blas_sys::cudaDataType_t::CUDA_R_16BF),
                // f32 mode: stored bf16 or Q8_0 weights expanded to f32 (Q8_0 experts in fast
                // mode took the chunked path above).
                (stored, _) => {
                    let (p, sp) = w.pointers(g);
                    let (kernel, ptrs) = match stored {
                        GpuWeights::Q8 { .. } => (&self.expand_q8_f32, vec![p, sp]),
                        _ => (&self.expand_bf16_f32, vec![p]),
                    };
                    let e = match &mut w32 {
                        Some(e) => e,
                        None => w32.insert(g.alloc::<f32>(n_w)?),
                    };
                    self.expand(kernel, &ptrs, n_w, g.ptr(e))?;
                    (g.ptr(e), blas_sys::cudaDataType_t::CUDA_R_32F)
                }
            };
            product(w, wp, w_type, r0, n)?;
        }
        Ok(())
    }

    /// The cuBLAS product on prepared operands (weights, their type, X, its type) into the f32
    /// rows at `yp`.
    fn gemm(&self, (wp, a_type, xp, b_type): (u64, blas_sys::cudaDataType_t, u64, blas_sys::cudaDataType_t), rows: usize, w: &GpuMatrix, yp: u64) -> Result<()> {
        let (m, n, k) = (int_arg("linear out", w.out)?, int_arg("linear rows", rows)?, int_arg("linear in", w.inp)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: W holds out × in, X rows × in and Y rows × out elements of the types named
        // (checked by the callers); the handle is bound to the GPU's stream.
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

    /// Whether fast mode's product of `rows` rows through `w` (past the GEMV and its row tiles)
    /// takes `tern_gemm_q8`: Q8_0 weights, at most `gemm_q8_rows_max` rows.
    pub(crate) fn gemm_q8_fits(&self, rows: usize, w: &GpuMatrix) -> bool {
        self.tensor_cores && w.kind() == KIND_Q8 && rows <= self.gemm_q8_rows_max && w.inp % 32 == 0
    }

    /// Y = X·Wᵀ for `rows` bf16 rows at `x16` through Q8_0 weights, read as stored
    /// (`tern_gemm_q8`; k split over [`gemm_q8_splits`] launches' worth of blocks, the parts
    /// then summed in split order by `tern_gemm_q8_sum`).
    fn gemm_q8(&self, x16: u64, rows: usize, w: &GpuMatrix, y: &mut CudaSlice<f32>) -> Result<()> {
        let g = &self.gpu;
        let GpuWeights::Q8 { quants, scales } = &w.w else {
            return Err(Error::Shape("tern_gemm_q8 of weights other than Q8_0".into()));
        };
        let (bm, bn, _, _) = GEMM_Q8_TILE;
        let splits = gemm_q8_splits(w.out, rows, w.inp, self.multiprocessors);
        let parts = if splits > 1 { Some(g.alloc::<f32>(splits * rows * w.out)?) } else { None };
        let dst = parts.as_ref().map_or(g.ptr(&*y), |p| g.ptr(p));
        let (qp, sp) = (g.ptr(quants), g.ptr(scales));
        let (r, out, inp, ks) = (int_arg("gemm rows", rows)?, int_arg("gemm out", w.out)?, int_arg("gemm in", w.inp)?, splits as i32);
        let mut l = g.launch_builder(&self.gemm_q8);
        l.arg(&qp).arg(&sp).arg(&x16).arg(&dst).arg(&r).arg(&out).arg(&inp).arg(&ks);
        let cfg = LaunchConfig {
            grid_dim: (grid_for(w.out, bm as u32)?, grid_for(rows, bn as u32)?, splits as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: GEMM_Q8_SMEM_BYTES as u32,
        };
        // SAFETY: argument types match tern_gemm_q8; the weights hold out × in quants (in % 32
        // == 0, checked by gemm_q8_fits) and their scales, x16 rows × in bf16 values (checked
        // by the callers), dst splits × rows × out values (y's, or the parts allocated above).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemm_q8"))?;
        if let Some(parts) = &parts {
            let (pp, yp, n) = (g.ptr(parts), g.ptr(&*y), (rows * w.out) as u64);
            let mut l = g.launch_builder(&self.gemm_q8_sum);
            l.arg(&pp).arg(&ks).arg(&n).arg(&yp);
            let cfg = LaunchConfig { grid_dim: (grid_for(rows * w.out, 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types match tern_gemm_q8_sum; parts holds splits × n values, y n.
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemm_q8_sum"))?;
        }
        Ok(())
    }

    /// Whether a product of `rows` rows with `w` takes the GEMV kernel (few rows; rows of
    /// whole steps of a lane (8 f32 or bf16 weights; Q8_0 rows are whole 32-weight blocks),
    /// which keep its vector loads aligned).
    fn gemv_fits(&self, rows: usize, w: &GpuMatrix) -> bool {
        rows <= self.gemv_max_rows && w.inp % 8 == 0
    }

    /// This handle with the normed forms ([`Blas::linear_residual_norm_then`],
    /// [`Blas::linear_residual_norm_conv`]) taken (`true`) or declined, whatever
    /// TERN_GEMV_NORMED says: the device test runs it.
    #[cfg(test)]
    pub(crate) fn with_gemv_normed(mut self, on: bool) -> Self {
        self.gemv_normed = on;
        self
    }

    /// This handle with one-row products requesting their first weights before awaiting the
    /// prior kernel (`true`) or not, whatever dependent launch and TERN_GEMV_EARLY say: the
    /// device test compares the two.
    #[cfg(test)]
    pub(crate) fn with_gemv_early(mut self, on: bool) -> Self {
        self.gemv_early = on;
        self
    }

    /// This handle with one-row Q8_0 products of many features on the one-feature kernel
    /// (`false`) or the paired one: the device test compares the two.
    #[cfg(test)]
    pub(crate) fn with_q8_paired(mut self, on: bool) -> Self {
        self.q8_paired = on;
        self
    }

    /// Whether a product of `rows` rows with `w` takes a GEMV ending in a norm: one row (a
    /// decode step of one sequence). The last block normalises the rows one after another,
    /// which at 8 rows cost more than the launch it saves (an 8-token EmbeddingGemma 300M query
    /// took 2.7 ms against 1.4 ms in two launches, H200); one warp per row did too (1.38 ms
    /// against 1.17 in f32 mode, and 8-sequence decode of a Qwen3.5-0.8B Q8_0 file 17% slower).
    pub fn norm_tail_fits(&self, rows: usize, w: &GpuMatrix) -> bool {
        rows <= NORM_TAIL_MAX_ROWS && self.gemv_fits(rows, w)
    }

    /// Several products of the same `rows` rows of x, `Y_i = X·W_iᵀ` for each `(W_i, Y_i)`:
    /// one GEMV launch when they fit it (few rows, at most [`GEMV_PARTS`] matrices of one
    /// stored type), else one [`Blas::linear`] each. CPU twin: [`super::linear_w`] per matrix.
    pub fn linears(&self, x: &CudaSlice<f32>, rows: usize, parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)]) -> Result<()> {
        if self.one_gemv(rows, &matrices(parts)) {
            check_len("linears input", x.len(), rows * parts[0].0.inp)?;
            for (w, y) in parts.iter() {
                check_len("linears output", y.len(), rows * w.out)?;
            }
            return self.gemv(x, GemvOutput::Plain, rows, parts);
        }
        for (w, y) in parts.iter_mut() {
            self.linear(x, rows, w, y)?;
        }
        Ok(())
    }

    /// Whether products of `rows` rows through `parts` run as one GEMV launch: at most
    /// [`GEMV_PARTS`] of them, each taking the GEMV, all of one stored type and input width.
    fn one_gemv(&self, rows: usize, ws: &[&GpuMatrix]) -> bool {
        let Some(first) = ws.first() else { return false };
        ws.len() <= GEMV_PARTS
            && ws.iter().all(|w| self.gemv_fits(rows, w) && std::mem::discriminant(&w.w) == std::mem::discriminant(&first.w) && w.inp == first.inp)
    }

    /// A gated-delta layer's input projections of one row (a decode step of one sequence) in
    /// one launch, the first part's outputs (conv channels) going through the causal conv1d +
    /// SiLU as they are written: `weight` [channels][kernel], `history` the sequence's
    /// [channels][kernel − 1] raw inputs (advanced). The same bits as [`Blas::linears`] then the
    /// conv kernel
    /// (`GatedDeltaCuda::conv1d_silu`). `Ok(false)`, with nothing queued, where the products do
    /// not take one CUDA-core launch (more rows, mixed weight types); the caller then runs the
    /// two.
    pub fn linears_conv(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)],
        conv: (&CudaSlice<f32>, usize),
        history: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        let Some(width_at) = self.conv_launch(rows, &matrices(parts), conv.1) else {
            return Ok(false);
        };
        check_len("linears_conv input", x.len(), parts[0].0.inp)?;
        self.linears_conv_launch(x, parts, conv, width_at, history, None)?;
        Ok(true)
    }

    /// Where products of `rows` rows through `parts` with a conv of width `kernel` on the first
    /// take one launch ([`Blas::linears_conv`]): the conv kernels' index of the width.
    fn conv_launch(&self, rows: usize, ws: &[&GpuMatrix], kernel: usize) -> Option<usize> {
        CONV_KERNEL_WIDTHS.iter().position(|&k| k == kernel).filter(|_| rows == 1 && self.one_gemv(rows, ws))
    }

    /// Queues [`Blas::linears_conv`]'s launch (its input checked by the caller), its input the
    /// norm it forms where `normed` is given.
    fn linears_conv_launch(
        &self,
        x: &CudaSlice<f32>,
        parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)],
        (weight, kernel): (&CudaSlice<f32>, usize),
        width_at: usize,
        history: &mut CudaSlice<f32>,
        normed: Option<NormedIn>,
    ) -> Result<()> {
        let channels = parts[0].0.out;
        for (w, y) in parts.iter() {
            check_len("linears_conv output", y.len(), w.out)?;
        }
        check_len("linears_conv conv weights", weight.len(), channels * kernel)?;
        check_len("linears_conv conv history", history.len(), channels * (kernel - 1))?;
        let g = &self.gpu;
        let conv = ConvTail { w: g.ptr(weight), at: g.ptr(&*history), part: 1 };
        self.gemv_with(x, GemvOutput::Plain, 1, parts, GemvExtras { conv: Some((conv, width_at)), normed, ..Default::default() })
    }

    /// [`Blas::linear_residual_norm`] of one row, then [`Blas::linears_conv`] of its `a`, in two
    /// launches with no norm tail between them (a dense FFN's down projection, then the next
    /// gated-delta layer's input projections): every block of the second forms `a` itself, as
    /// [`Blas::linear_residual_norm_then`]'s second product does (the same bits), block 0 also
    /// writing it. `Ok(false)`, nothing queued, where it is off ([`Blas::gemv_normed`]) or does
    /// not apply: the conv products not one launch, a stream of more than [`NORMED_MAX`] values.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_residual_norm_conv(
        &self,
        v: &CudaSlice<f32>,
        w: &GpuMatrix,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        a: &mut CudaSlice<f32>,
        parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)],
        conv: (&CudaSlice<f32>, usize),
        history: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        let Some(width_at) = self.takes_normed_conv(w, &matrices(parts), conv.1) else {
            return Ok(false);
        };
        let normed = self.residual_leaving_norm(v, w, x, norm, eps, a)?;
        self.linears_conv_launch(x, parts, conv, width_at, history, Some(normed))?;
        Ok(true)
    }

    /// Where [`Blas::linear_residual_norm_conv`] takes these products: the conv kernels' index
    /// of the width.
    pub fn takes_normed_conv(&self, w: &GpuMatrix, ws: &[&GpuMatrix], kernel: usize) -> Option<usize> {
        let fits = self.takes_normed_input(w) && ws.first().is_some_and(|m| m.inp == w.out);
        self.conv_launch(1, ws, kernel).filter(|_| fits)
    }

    /// Whether a one-row residual product through `w` may leave its norm to the product after
    /// it (the normed kernels, which copy the norm's weights four at a time; [`Blas::gemv_normed`]).
    fn takes_normed_input(&self, w: &GpuMatrix) -> bool {
        self.gemv_normed && self.norm_tail_fits(1, w) && w.out <= NORMED_MAX && w.out % 4 == 0
    }

    /// The first launch of the normed forms: `x += v·wᵀ` with no norm tail (checked lengths),
    /// and the operands with which the next launch forms `a = rms(x)·norm` and writes it.
    fn residual_leaving_norm(&self, v: &CudaSlice<f32>, w: &GpuMatrix, x: &mut CudaSlice<f32>, norm: &CudaSlice<f32>, eps: f32, a: &CudaSlice<f32>) -> Result<NormedIn> {
        let d = w.out;
        check_len("normed input's residual product input", v.len(), w.inp)?;
        check_len("normed input's residual", x.len(), d)?;
        check_len("normed input's norm weight", norm.len(), d)?;
        check_len("normed input's normed row", a.len(), d)?;
        let g = &self.gpu;
        // The blocks copy the norm's weights 16 bytes at a time (an allocation's start is).
        if g.ptr(norm) % 16 != 0 {
            return Err(Error::Shape("normed input: the norm's weights are not 16-byte aligned".into()));
        }
        // The residual product with no norm (norm_out 0: the kernel skips its tail).
        let tail = NormTail { norm_w: g.ptr(norm), norm_out: 0, counter: g.ptr(&self.residual_counter), eps, stream: 0, next_w: 0, post: 1.0 };
        self.gemv_with(v, GemvOutput::Residual, 1, &mut [(w, &mut *x)], GemvExtras { tail: Some(tail), ..Default::default() })?;
        Ok(NormedIn { h: g.ptr(&*x), w: g.ptr(norm), a: g.ptr(a), eps })
    }

    /// `y = gelu_tanh(x·Wᵀ) · up` over `rows` rows, `up` row r at `up.offset + r·up.stride` of
    /// its buffer (EmbeddingGemma 2's per-layer input gate), in one tensor-core GEMV launch:
    /// the same bits as [`Blas::linear`] (which takes the same kernel's product for these rows)
    /// and then the gated activation kernel. `Ok(false)`, with nothing queued, where the product
    /// does not take the tensor-core GEMV (one row, more than [`GEMV_MAX_ROWS`], f32 mode or
    /// weights it does not take) or `up`'s rows would overlap; the caller then runs the two.
    pub fn linear_gelu_by(&self, x: &CudaSlice<f32>, rows: usize, w: &GpuMatrix, up: View<CudaSlice<f32>>, y: &mut CudaSlice<f32>) -> Result<bool> {
        // Only where Blas::linear takes this kernel's product (TERN_GEMV_MAX_ROWS included), and
        // for views the composed path accepts (its checks then report the others).
        if !(self.gemv_fits(rows, w) && self.gemv_mma_fits(rows, GemvOutput::Plain, [w].into_iter())) || w.out == 0 || up.stride < w.out {
            return Ok(false);
        }
        check_len("linear_gelu_by input", x.len(), rows * w.inp)?;
        check_len("linear_gelu_by output", y.len(), rows * w.out)?;
        check_view("linear_gelu_by up", up.buf.len(), up.offset, up.stride, rows, w.out)?;
        let (r, inp) = (int_arg("gemv rows", rows)?, int_arg("gemv in", w.inp)?);
        // Row r < rows of `up` spans w.out values from up.offset + r·up.stride inside its
        // buffer (checked above).
        let up = (self.gpu.ptr(up.buf) + 4 * up.offset as u64, up.stride as i64);
        self.gemv_mma(x, GemvOutput::Plain, r, inp, &mut [(w, y)], Some(up))?;
        Ok(true)
    }

    /// The gated linear unit `Y = act(X·Gᵀ)·(X·Uᵀ)` for `w` stacking a gate G [h][in] over an
    /// up U [h][in]; Y is [rows][h]. A GEMV that writes the gated values when the product takes
    /// one (the activation costs nothing and X·Wᵀ never goes to memory); else the product into a
    /// scratch [rows][2h] and `activate(scratch, y)`, the activation kernel. CPU twin:
    /// [`super::linear_w`], then the gated activation of its two halves.
    pub fn glu(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        w: &GpuMatrix,
        output: GemvOutput,
        y: &mut CudaSlice<f32>,
        activate: impl FnOnce(&CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<()> {
        if !output.gated() || w.out % 2 != 0 {
            return Err(Error::Shape(format!("glu: a gated activation over {} stacked rows", w.out)));
        }
        check_len("glu input", x.len(), rows * w.inp)?;
        check_len("glu output", y.len(), rows * w.out / 2)?;
        if rows == 0 {
            return Ok(());
        }
        if self.gemv_fits(rows, w) {
            return self.gemv(x, output, rows, &mut [(w, y)]);
        }
        let mut gu = self.gpu.alloc::<f32>(rows * w.out)?;
        self.linear(x, rows, w, &mut gu)?;
        activate(&gu, y)
    }

    /// [`Blas::linear_residual_norm`] of one row, then the one-row product of its `a` through
    /// `next` in `output`'s form (plain: [`Blas::linear`], as an attention layer's q|gate|k|v
    /// product after a dense FFN's down projection; gated: [`Blas::glu`], as a dense FFN's
    /// gate|up product after the output projection), in two launches with no norm tail between
    /// them: the first adds its product to the stream `x`, and every block of the second forms
    /// `a = rms(x)·norm` itself, as the tail would (the same slots, sums and order: the same
    /// bits), block 0 also writing `a`. The tail's last block no longer holds up the launch
    /// after it (~2 µs a product on an H100, BENCHMARKS.md 2026-12-05). `Ok(false)`, nothing
    /// queued, where it is off (TERN_GEMV_NORMED=0: [`Blas::gemv_normed`]) or does not apply
    /// ([`Blas::takes_normed_product`]).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_residual_norm_then(
        &self,
        v: &CudaSlice<f32>,
        w: &GpuMatrix,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        a: &mut CudaSlice<f32>,
        next: &GpuMatrix,
        output: GemvOutput,
        y: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        if !self.takes_normed_product(w, next, output) {
            return Ok(false);
        }
        check_len("linear_residual_norm_then output", y.len(), output.features(next))?;
        let normed = self.residual_leaving_norm(v, w, x, norm, eps, a)?;
        // (The launch's x is not read: its input is the one it forms.)
        self.gemv_with(x, output, 1, &mut [(next, y)], GemvExtras { normed: Some(normed), ..Default::default() })?;
        Ok(true)
    }

    /// Whether [`Blas::linear_residual_norm_then`] takes these products: a plain or gated
    /// product of one row taking the GEMV, of the stream's width; not one that takes the paired
    /// Q8_0 kernel (a vocabulary head: its many blocks would each form the norm for one tail's
    /// worth of time).
    pub fn takes_normed_product(&self, w: &GpuMatrix, next: &GpuMatrix, output: GemvOutput) -> bool {
        let form_fits = match output {
            GemvOutput::Plain => !(self.q8_paired && next.out >= Q8_PAIRED_MIN_FEATURES && matches!(next.w, GpuWeights::Q8 { .. })),
            GemvOutput::Silu | GemvOutput::GeluTanh => next.out % 2 == 0,
            GemvOutput::Residual | GemvOutput::AddNorm => false,
        };
        form_fits && self.takes_normed_input(w) && self.gemv_fits(1, next) && next.inp == w.out
    }

    /// A pre-norm residual step after a product: `x += V·Wᵀ`, then `a = rms(x)·norm` per row
    /// of `w.out` — one GEMV launch (the last block normalises) for one row, the same bits as
    /// [`Blas::linear`] and the residual norm kernel; `Ok(false)` for more rows (the caller
    /// runs the two). CPU twin: [`super::linear_w`], then
    /// [`crate::kernels::norm::residual_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_residual_norm(
        &self,
        v: &CudaSlice<f32>,
        rows: usize,
        w: &GpuMatrix,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        a: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        if !self.norm_tail_fits(rows, w) {
            return Ok(false);
        }
        check_len("linear_residual_norm input", v.len(), rows * w.inp)?;
        check_len("linear_residual_norm residual", x.len(), rows * w.out)?;
        check_len("linear_residual_norm weight", norm.len(), w.out)?;
        check_len("linear_residual_norm output", a.len(), rows * w.out)?;
        if rows > 0 {
            let g = &self.gpu;
            let tail = NormTail { norm_w: g.ptr(norm), norm_out: g.ptr(a), counter: g.ptr(&self.residual_counter), eps, stream: 0, next_w: 0, post: 1.0 };
            self.gemv_with(v, GemvOutput::Residual, rows, &mut [(w, x)], GemvExtras { tail: Some(tail), ..Default::default() })?;
        }
        Ok(true)
    }

    /// EmbeddingGemma's sandwich-norm step after a product: `y = V·Wᵀ` (into `y`), then
    /// `h = (h + rms(y)·norm)·post` and `a = rms(h)·next` per row of `w.out` — one GEMV launch
    /// (the last block normalises) for one row, the same bits as [`Blas::linear`] and the
    /// add-norm kernel; `Ok(false)` for more rows. CPU twin:
    /// [`super::linear_w`], then [`crate::kernels::norm::add_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_add_norm_next(
        &self,
        v: &CudaSlice<f32>,
        rows: usize,
        w: &GpuMatrix,
        y: &mut CudaSlice<f32>,
        h: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        post: f32,
        eps: f32,
        next: &CudaSlice<f32>,
        a: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        if !self.norm_tail_fits(rows, w) {
            return Ok(false);
        }
        check_len("linear_add_norm_next input", v.len(), rows * w.inp)?;
        for (what, len) in [("product", y.len()), ("residual", h.len()), ("output", a.len())] {
            check_len(&format!("linear_add_norm_next {what}"), len, rows * w.out)?;
        }
        check_len("linear_add_norm_next weight", norm.len(), w.out)?;
        check_len("linear_add_norm_next next weight", next.len(), w.out)?;
        if rows > 0 {
            let g = &self.gpu;
            let counter = g.ptr(&self.residual_counter);
            let tail = NormTail { norm_w: g.ptr(norm), norm_out: g.ptr(a), counter, eps, stream: g.ptr(h), next_w: g.ptr(next), post };
            self.gemv_with(v, GemvOutput::AddNorm, rows, &mut [(w, y)], GemvExtras { tail: Some(tail), ..Default::default() })?;
        }
        Ok(true)
    }

    /// One GEMV launch over `parts` (at most [`GEMV_PARTS`], one stored type, shapes checked
    /// by the caller), for at most [`GEMV_MAX_ROWS`] rows; `in` % 8 == 0.
    fn gemv(&self, x: &CudaSlice<f32>, output: GemvOutput, rows: usize, parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)]) -> Result<()> {
        self.gemv_with(x, output, rows, parts, GemvExtras::default())
    }

    /// [`Blas::gemv`], with what [`GemvExtras`] adds.
    fn gemv_with(&self, x: &CudaSlice<f32>, output: GemvOutput, rows: usize, parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)], extras: GemvExtras) -> Result<()> {
        let GemvExtras { tail, conv, normed } = extras;
        let one_product = parts.len() == 1 && (output == GemvOutput::Plain || output.gated());
        if normed.is_some() && !(rows == 1 && (one_product || (output == GemvOutput::Plain && conv.is_some()))) {
            return Err(Error::Shape("gemv: a normed input takes one row of one plain or gated product, or of products with a conv part".into()));
        }
        let tailed = matches!(output, GemvOutput::Residual | GemvOutput::AddNorm);
        if tailed != (tail.is_some() && parts.len() == 1) {
            return Err(Error::Shape("gemv: a norm after the product takes one product and its operands".into()));
        }
        let g = &self.gpu;
        let first = parts.first().map(|(w, _)| *w).ok_or_else(|| Error::Shape("gemv: no product".into()))?;
        let (r, inp) = (int_arg("gemv rows", rows)?, int_arg("gemv in", first.inp)?);
        if tail.is_none() && conv.is_none() && normed.is_none() && self.gemv_mma_fits(rows, output, parts.iter().map(|(w, _)| *w)) {
            return self.gemv_mma(x, output, r, inp, parts, None);
        }
        let features: usize = parts.iter().map(|(w, _)| output.features(w)).sum();
        let ks = if self.gemv_split { gemv_split(features, first.inp, self.multiprocessors) } else { 1 };
        let ks = if self.gemv_split_early { ks.min(gemv_split_filling_early(first.inp, GEMV_EARLY_STEPS[first.kind()])) } else { ks };
        let mut p = GemvParts { n: parts.len() as i32, ks: ks as i32, tail: tail.unwrap_or_default(), conv: conv.map(|(c, _)| c).unwrap_or_default(), ..Default::default() };
        // Features a block covers: its warps' feature groups (ks warps each) times the
        // features a warp holds.
        // A one-row Q8_0 product of many features (a vocabulary head) takes the paired kernel,
        // two features a warp ([`Q8_PAIRED_MIN_FEATURES`]).
        let paired = self.q8_paired
            && conv.is_none()
            && normed.is_none()
            && ks == 1
            && rows == 1
            && output == GemvOutput::Plain
            && parts.len() == 1
            && features >= Q8_PAIRED_MIN_FEATURES
            && matches!(first.w, GpuWeights::Q8 { .. });
        let per_block = |narrow| if paired { 2 * GEMV_WARPS } else { GEMV_WARPS / ks * gemv_outputs_per_warp(rows, output, narrow) };
        // The wide form unless its blocks would not cover every multiprocessor twice.
        let wide_blocks: usize = parts.iter().map(|(w, _)| output.features(w).div_ceil(per_block(false))).sum();
        let narrow = !paired && wide_blocks < 2 * self.multiprocessors;
        let blocks = self.gemv_parts(&mut p, output, parts, per_block(narrow) as u32)?;
        // 1: the first weights requested before the wait; 2: also the next kernel let be
        // scheduled first (Gpu::early_trigger).
        p.early = if self.gemv_early && rows == 1 { 1 + g.early_trigger() as i32 } else { 0 };
        if let Some(n) = normed {
            (p.in_h, p.in_w, p.in_a, p.in_eps) = (n.h, n.w, n.a, n.eps);
        }
        let xp = g.ptr(x);
        let kernel = if paired {
            &self.q8_paired_kernel
        } else if let Some((_, width_at)) = conv {
            &(if normed.is_some() { &self.conv_normed_kernels } else { &self.conv_kernels })[width_at][first.kind()]
        } else if normed.is_some() {
            &self.normed_kernels[output.index()][first.kind()]
        } else {
            self.gemv.get(output, first, rows, narrow)
        };
        let mut l = g.launch_builder(kernel);
        l.arg(&p).arg(&xp).arg(&r).arg(&inp).triggers_early(p.early == 2);
        // A normed input and its norm's weights live in the block's dynamic shared memory (4
        // bytes a value each).
        let shared_mem_bytes = if normed.is_some() { 8 * first.inp as u32 } else { 0 };
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * GEMV_WARPS as u32, 1, 1), shared_mem_bytes };
        // SAFETY: argument types match tern_gemv_*; the kernel (R >= rows) reads each part's
        // out × in weights of the one type it is compiled for and writes rows × features
        // outputs (out, or out / 2 gated; lengths checked by the callers); x holds rows × in
        // values; in % 8 == 0 keeps the vector loads aligned.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemv"))?;
        Ok(())
    }

    /// Fills `p`'s matrices, outputs and block ranges for `parts`, `per_block` features a
    /// block; the launch's block count.
    fn gemv_parts(&self, p: &mut GemvParts, output: GemvOutput, parts: &[(&GpuMatrix, &mut CudaSlice<f32>)], per_block: u32) -> Result<u32> {
        let g = &self.gpu;
        let mut blocks = 0u32;
        for (i, (w, y)) in parts.iter().enumerate() {
            let (wp, sp) = w.pointers(g);
            p.w[i] = wp;
            p.scales[i] = sp;
            p.y[i] = g.ptr(&**y);
            let features = output.features(w);
            p.out[i] = int_arg("gemv out", features)?;
            p.block0[i] = blocks as i32;
            blocks += grid_for(features, per_block)?;
        }
        p.block0[parts.len()] = int_arg("gemv blocks", blocks as usize)?;
        Ok(blocks)
    }

    /// Whether a product of `rows` rows with these matrices takes the tensor-core GEMV: fast
    /// mode, 2 to [`GEMV_MAX_ROWS`] rows (one row keeps the CUDA-core form and its f32 x: a
    /// decode step of one sequence), weights it takes ([`Blas::mma_kind`]), rows of whole
    /// 32-weight chunks, plain or gated outputs.
    fn gemv_mma_fits<'m>(&self, rows: usize, output: GemvOutput, mut ms: impl Iterator<Item = &'m GpuMatrix>) -> bool {
        (2..=GEMV_MAX_ROWS).contains(&rows)
            && matches!(output, GemvOutput::Plain | GemvOutput::Silu | GemvOutput::GeluTanh)
            && ms.all(|w| self.mma_kind(w.kind()).is_some() && w.inp % 32 == 0)
    }

    /// The tensor-core GEMV's weight index (0: bf16, 1: Q8_0) for weights of [`GpuMatrix::kind`]
    /// `kind`, or None where they keep the CUDA-core GEMV (f32 mode, f32 weights,
    /// TERN_GEMV_MMA=0, Q8_0 with TERN_GEMV_MMA_Q8=0).
    fn mma_kind(&self, kind: usize) -> Option<usize> {
        if !self.tensor_cores || !self.gemv_mma {
            return None;
        }
        match kind {
            KIND_BF16 => Some(0),
            KIND_Q8 if self.gemv_mma_q8 => Some(1),
            _ => None,
        }
    }

    /// This handle with the tensor-core GEMV's four-steps-ahead form on or off, whatever
    /// TERN_GEMV_MMA_AHEAD says: the device test runs both.
    #[cfg(test)]
    pub(crate) fn with_gemv_mma_ahead(mut self, on: bool) -> Self {
        self.gemv_mma_ahead = on;
        self
    }

    /// This handle with fast mode's Q8_0 products of up to `rows` rows on `tern_gemm_q8` (0:
    /// none), whatever TERN_GEMM_Q8_ROWS says: the device test runs both.
    #[cfg(test)]
    pub(crate) fn with_gemm_q8_rows_max(mut self, rows: usize) -> Self {
        self.gemm_q8_rows_max = rows;
        self
    }

    /// This handle with fast mode's Q8_0 products of up to `rows` rows on the tensor-core GEMV's
    /// row tiles (0: none), in decode steps and out of them, whatever TERN_GEMV_MMA_ROWS and
    /// TERN_GEMV_MMA_STEP_ROWS say: the device test runs both.
    #[cfg(test)]
    pub(crate) fn with_mma_rows_max(mut self, rows: usize) -> Self {
        self.mma_rows_max = [rows; 2];
        self
    }

    /// This handle with Q8_0 weights on the tensor-core GEMV (`true`) or not: the device test
    /// runs it whatever TERN_GEMV_MMA_Q8 says.
    #[cfg(test)]
    pub(crate) fn with_gemv_mma_q8(mut self, on: bool) -> Self {
        self.gemv_mma_q8 = on;
        self
    }

    /// [`Blas::gemv`] on the tensor cores (`tern_gemv_mma_*`): 16 features a block. With
    /// `gelu_by` (the address and row stride of a view the caller checked), the plain outputs'
    /// gelu times that view's values instead ([`Blas::linear_gelu_by`]).
    fn gemv_mma(
        &self,
        x: &CudaSlice<f32>,
        output: GemvOutput,
        rows: i32,
        inp: i32,
        parts: &mut [(&GpuMatrix, &mut CudaSlice<f32>)],
        gelu_by: Option<(u64, i64)>,
    ) -> Result<()> {
        let g = &self.gpu;
        let (up, up_ld) = gelu_by.unwrap_or_default();
        let mut p = GemvParts { n: parts.len() as i32, ks: 1, up, up_ld, ..Default::default() };
        let blocks = self.gemv_parts(&mut p, output, parts, 16)?;
        // Every part has the first's weight type (the caller's check).
        let m = self.mma_kind(parts[0].0.kind()).ok_or_else(|| Error::Shape("gemv: weights the tensor-core GEMV does not take".into()))?;
        let kernels = if self.gemv_mma_ahead { &self.mma_ahead_kernels } else { &self.mma_kernels };
        let kernel = match (output, gelu_by) {
            (_, Some(_)) => &self.mma_gelu_by[self.gemv_mma_ahead as usize][m],
            (GemvOutput::Silu, None) => &kernels[m][1],
            (GemvOutput::GeluTanh, None) => &kernels[m][2],
            _ => &kernels[m][0],
        };
        let xp = g.ptr(x);
        let mut l = g.launch_builder(kernel);
        l.arg(&p).arg(&xp).arg(&rows).arg(&inp);
        // Tiles of 8 rows (one where rows <= 8: Blas::linear's row tiles take more).
        let tiles = (rows.max(1) as u32).div_ceil(GEMV_MAX_ROWS as u32);
        let cfg = LaunchConfig { grid_dim: (blocks, tiles, 1), block_dim: (32 * GEMV_WARPS as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_gemv_mma_* (both forms); each part's out × in weights of the
        // kernel's type (in % 32 == 0: whole chunks of 8-weight loads) and rows × features
        // outputs (lengths checked by the callers); x holds rows rows of in values, tile t
        // reading and writing rows 8t .. min(8t + 8, rows); a gelu_by view holds rows rows of out
        // values (checked by linear_gelu_by).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemv_mma"))?;
        Ok(())
    }

    /// The address tables of `ms` for [`Blas::routed`], or None when they cannot share one
    /// (different shapes or stored types, or rows the GEMV does not take).
    pub fn matrix_table(&self, ms: &[&GpuMatrix]) -> Result<Option<GpuMatrixTable>> {
        let Some(first) = ms.first() else { return Ok(None) };
        if ms.iter().any(|m| (m.out, m.inp, m.kind()) != (first.out, first.inp, first.kind())) || !self.gemv_fits(1, first) {
            return Ok(None);
        }
        let (weights, scales): (Vec<u64>, Vec<u64>) = ms.iter().map(|m| m.pointers(&self.gpu)).unzip();
        Ok(Some(GpuMatrixTable {
            weights: self.gpu.upload(&weights)?,
            scales: self.gpu.upload(&scales)?,
            kind: first.kind(),
            len: ms.len(),
            out: first.out,
            inp: first.inp,
        }))
    }

    /// Routed products: for each of `slots` slots s, row s of `y` is the product of the
    /// expert `ids[s]`'s matrix with row s / x_div of `x` (rows of `in`): plain outputs, or the
    /// gated activation of a stacked gate|up matrix ([`GemvOutput`]). The ids are device values
    /// below `table.len` (the routing kernel's). CPU twin: [`super::linear_w`] of each slot's
    /// expert (and the gated activation).
    #[allow(clippy::too_many_arguments)]
    pub fn routed(
        &self,
        table: &GpuMatrixTable,
        ids: &CudaSlice<i32>,
        slots: usize,
        x: &CudaSlice<f32>,
        x_div: usize,
        output: GemvOutput,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let features = match output {
            GemvOutput::Plain => table.out,
            GemvOutput::Silu if table.out % 2 == 0 => table.out / 2,
            _ => return Err(Error::Shape(format!("routed: plain or silu-gated products of {} rows", table.out))),
        };
        check_len("routed ids", ids.len(), slots)?;
        if x_div == 0 || slots % x_div != 0 {
            return Err(Error::Shape(format!("routed: {slots} slots over input rows of {x_div} slots each")));
        }
        check_len("routed input", x.len(), slots / x_div * table.inp)?;
        check_len("routed output", y.len(), slots * features)?;
        if slots == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let slots_y = u32::try_from(slots).ok().filter(|&n| n <= 65_535).ok_or_else(|| Error::Shape(format!("routed: {slots} slots, at most 65535")))?;
        let (div, inp, out) = (int_arg("routed x_div", x_div)?, int_arg("routed in", table.inp)?, int_arg("routed out", features)?);
        let (wt, st, ip, xp, yp) = (g.ptr(&table.weights), g.ptr(&table.scales), g.ptr(ids), g.ptr(x), g.ptr(y));
        let f = &self.routed[(output == GemvOutput::Silu) as usize][table.kind];
        let mut l = g.launch_builder(f);
        l.arg(&wt).arg(&st).arg(&ip).arg(&div).arg(&xp).arg(&inp).arg(&out).arg(&yp);
        let cfg = LaunchConfig { grid_dim: (grid_for(features, GEMV_WARPS as u32)?, slots_y, 1), block_dim: (32 * GEMV_WARPS as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_gemv_routed_*; the tables hold `len` matrices of
        // out × in weights of the kernel's type, and the ids (written by the routing kernel) are
        // below `len`; x, y and ids hold what the slots read and write (checked above).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemv_routed"))?;
        Ok(())
    }

    /// Whether [`Self::tiles`] runs this table's products on the tensor cores.
    pub fn tiles_on_tensor_cores(&self, table: &GpuMatrixTable) -> bool {
        self.tiles_mma(table).is_some()
    }

    /// The tensor-core GEMV's weight index for this table's tiles (rows of whole 32-weight
    /// chunks), or None where they run on the CUDA cores.
    fn tiles_mma(&self, table: &GpuMatrixTable) -> Option<usize> {
        self.mma_kind(table.kind).filter(|_| table.inp % 32 == 0)
    }

    /// The checks and kernel choice of the two tile launchers: (features, rows, the kernel's
    /// [plain, silu] and [tensor-core weights] indices, features a block).
    fn tiles_form(&self, table: &GpuMatrixTable, x: &CudaSlice<f32>, output: GemvOutput, y: &CudaSlice<f32>) -> Result<(usize, usize, usize, Option<usize>, u32)> {
        let features = match output {
            GemvOutput::Plain => table.out,
            GemvOutput::Silu if table.out % 2 == 0 => table.out / 2,
            _ => return Err(Error::Shape(format!("tiles: plain or silu-gated products of {} rows", table.out))),
        };
        if table.inp == 0 || x.len() % table.inp != 0 {
            return Err(Error::Shape(format!("tiles: {} inputs are not rows of {}", x.len(), table.inp)));
        }
        let rows = x.len() / table.inp;
        check_len("tiles output", y.len(), rows * features)?;
        let silu = (output == GemvOutput::Silu) as usize;
        // Weights the tensor-core GEMV takes: its form, 16 features a block.
        let mma = self.tiles_mma(table);
        Ok((features, rows, silu, mma, if mma.is_some() { 16 } else { GEMV_WARPS as u32 }))
    }

    /// Expert products over rows sorted by expert, as GEMVs of tiles of at most
    /// [`GEMV_MAX_ROWS`] rows: for each tile (e, r0, n) of `tiles` ([`expert_tiles`]), rows
    /// r0 .. r0 + n of `y` are the products of expert e's matrix (`table`) with the same rows of
    /// `x` (rows of `in`): plain outputs, or the gated activation of a stacked gate|up matrix.
    /// Each row's result is the one [`Blas::routed`] gives it alone, except where the weights
    /// take the tensor-core GEMV (fast mode's bf16 and Q8_0 weights): the tiles then run there
    /// as [`Blas::gemv`]'s products of several rows do (x rounded to bf16). CPU twin:
    /// [`super::linear_w`] of each row's expert (and the gated activation).
    pub fn tiles(&self, table: &GpuMatrixTable, tiles: &[[i32; 3]], x: &CudaSlice<f32>, output: GemvOutput, y: &mut CudaSlice<f32>) -> Result<()> {
        let (features, rows, silu, mma, per_block) = self.tiles_form(table, x, output, y)?;
        for &[e, r0, n] in tiles {
            let fits = usize::try_from(e).is_ok_and(|e| e < table.len) && r0 >= 0 && (1..=GEMV_MAX_ROWS as i32).contains(&n) && r0 as usize + n as usize <= rows;
            if !fits {
                return Err(Error::Shape(format!("tiles: tile ({e}, {r0}, {n}) of {rows} rows and {} experts", table.len)));
            }
        }
        let g = &self.gpu;
        let (inp, out) = (int_arg("tiles in", table.inp)?, int_arg("tiles out", features)?);
        let f = match mma {
            Some(m) => &self.mma_tiles[m][silu],
            None => &self.tiles[silu][table.kind],
        };
        // The grid's y dimension holds at most 65535 tiles a launch.
        for chunk in tiles.chunks(65_535) {
            let flat: Vec<i32> = chunk.iter().flatten().copied().collect();
            let dt = g.upload(&flat)?;
            let (wt, st, tp, xp, yp) = (g.ptr(&table.weights), g.ptr(&table.scales), g.ptr(&dt), g.ptr(x), g.ptr(&*y));
            let mut l = g.launch_builder(f);
            l.arg(&wt).arg(&st).arg(&tp).arg(&xp).arg(&inp).arg(&out).arg(&yp);
            let cfg = LaunchConfig { grid_dim: (grid_for(features, per_block)?, chunk.len() as u32, 1), block_dim: (32 * GEMV_WARPS as u32, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types match tern_gemv_tiles_* and tern_gemv_mma_tiles_* (in % 32
            // == 0: whole chunks of 8-weight loads); each tile's expert is below the
            // tables' `len` (matrices of out × in weights of the kernel's type) and its rows lie
            // in x (rows × in) and y (rows × features), checked above; the tiles' buffer lives
            // until the stream has run the launch (freed in stream order).
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemv_tiles"))?;
        }
        Ok(())
    }

    /// [`Self::tiles`] over a tile list made on the device ([`crate::kernels::moe::cuda::MoeCuda::sort_slots`]):
    /// `tiles` holds room for `max_tiles` tiles of which the first `n_tiles[0]` are set, so the
    /// host neither knows nor uploads them and a recorded step can replay the launch. The same
    /// kernels' products (the tile forms with a count), the same bits as [`Self::tiles`] for
    /// the same tiles.
    #[allow(clippy::too_many_arguments)]
    pub fn tiles_counted(
        &self,
        table: &GpuMatrixTable,
        tiles: &CudaSlice<i32>,
        n_tiles: &CudaSlice<i32>,
        max_tiles: usize,
        x: &CudaSlice<f32>,
        output: GemvOutput,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (features, _rows, silu, mma, per_block) = self.tiles_form(table, x, output, y)?;
        check_len("counted tiles", tiles.len(), 3 * max_tiles)?;
        check_len("tile count", n_tiles.len(), 1)?;
        if max_tiles == 0 {
            return Ok(());
        }
        let grid_y = u32::try_from(max_tiles).ok().filter(|&t| t <= 65_535).ok_or_else(|| Error::Shape(format!("counted tiles: {max_tiles} tiles, at most 65535 a launch")))?;
        let g = &self.gpu;
        let (inp, out) = (int_arg("tiles in", table.inp)?, int_arg("tiles out", features)?);
        let f = match mma {
            Some(m) => &self.mma_tiles_counted[m][silu],
            None => &self.tiles_counted[silu][table.kind],
        };
        let (wt, st, tp, np, xp, yp) = (g.ptr(&table.weights), g.ptr(&table.scales), g.ptr(tiles), g.ptr(n_tiles), g.ptr(x), g.ptr(&*y));
        let mut l = g.launch_builder(f);
        l.arg(&wt).arg(&st).arg(&tp).arg(&np).arg(&xp).arg(&inp).arg(&out).arg(&yp);
        let cfg = LaunchConfig { grid_dim: (grid_for(features, per_block)?, grid_y, 1), block_dim: (32 * GEMV_WARPS as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_gemv_tiles_*_counted and tern_gemv_mma_tiles_*_counted;
        // blocks past n_tiles[0] (at most max_tiles, the buffer's room) return at once, and the
        // tiles below it were written by tern_moe_sort_slots over x's rows: experts below the
        // tables' `len`, rows inside x (rows × in) and y (rows × features).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemv_tiles (counted)"))?;
        Ok(())
    }

    /// A one-row decode step's routed experts summed into the residual stream, then its norm:
    /// `x += Σ_j weights[j] · (W_{ids[j]} · act[j])` over the row's `per_row` slots (in slot
    /// order), then `a = rms(x)·norm` (x and a: one row of `table.out`). One launch whose last
    /// block normalises; the same bits as [`Blas::routed`] (plain), the MoE combine and the
    /// residual norm kernel. CPU twin: the MoE's expert sum ([`crate::kernels::moe`]), then
    /// [`crate::kernels::norm::residual_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn routed_residual_norm(
        &self,
        table: &GpuMatrixTable,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        per_row: usize,
        act: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
        a: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let d = table.out;
        if d == 0 || per_row == 0 || per_row > 32 {
            return Err(Error::Shape(format!("routed_residual_norm: rows of {d}, {per_row} slots a row (1 to 32)")));
        }
        for (what, len) in [("residual", x.len()), ("norm weight", norm.len()), ("norm output", a.len())] {
            check_len(&format!("routed_residual_norm {what}"), len, d)?;
        }
        check_len("routed_residual_norm ids", ids.len(), per_row)?;
        check_len("routed_residual_norm weights", weights.len(), per_row)?;
        check_len("routed_residual_norm input", act.len(), per_row * table.inp)?;
        let g = &self.gpu;
        let tail = NormTail { norm_w: g.ptr(norm), norm_out: g.ptr(&*a), counter: g.ptr(&self.residual_counter), eps, stream: 0, next_w: 0, post: 1.0 };
        let mut p = GemvParts { n: 1, ks: 1, tail, ..Default::default() };
        p.y[0] = g.ptr(&*x);
        p.out[0] = int_arg("routed_residual_norm out", d)?;
        let (pr, inp) = (int_arg("routed_residual_norm slots", per_row)?, int_arg("routed_residual_norm in", table.inp)?);
        let (wt, st, ip, wp, ap) = (g.ptr(&table.weights), g.ptr(&table.scales), g.ptr(ids), g.ptr(weights), g.ptr(act));
        let mut l = g.launch_builder(&self.routed_residual[table.kind]);
        l.arg(&p).arg(&wt).arg(&st).arg(&ip).arg(&wp).arg(&pr).arg(&ap).arg(&inp);
        let cfg = LaunchConfig { grid_dim: (grid_for(d, GEMV_WARPS as u32)?, 1, 1), block_dim: (32 * GEMV_WARPS as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_gemv_routed_res_*; the tables hold `len` matrices of
        // out × in weights of the kernel's type and the ids (the routing kernel's) are below
        // `len`; ids and weights hold per_row slots, act a row of `in` per slot, x, norm and a
        // d values (checked above); one row, so the grid's blocks are the counter's arrivals.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gemv_routed_res"))?;
        Ok(())
    }

    /// Expands `n` stored weights (their buffers' pointers) into an operand buffer.
    fn expand(&self, f: &CudaFunction, weights: &[u64], n: usize, dst: u64) -> Result<()> {
        let g = &self.gpu;
        let count = n as u64;
        let mut l = g.launch_builder(f);
        for p in weights {
            l.arg(p);
        }
        l.arg(&count).arg(&dst);
        // Eight weights a thread (the kernels' step; a grid-stride loop past the bound).
        let cfg = LaunchConfig { grid_dim: (grid_for(n.div_ceil(8), 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_expand_*; the weights hold n values (and n / 32
        // scales) and dst n operands (allocated by the caller); the kernels take their wide
        // accesses only where both buffers are aligned for them.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_expand"))?;
        Ok(())
    }

    /// Weights `skip .. skip + n` of `w` as the products expand them: bf16 bits (fast mode,
    /// Q8_0 weights) or f32 (f32 mode, bf16 or Q8_0 weights). For the device tests, which reach
    /// the kernels' wide and one-a-thread paths through the count and the start (a bf16 start
    /// off 16 bytes; Q8_0 starts are whole 32-weight blocks).
    #[cfg(test)]
    pub(crate) fn expanded(&self, w: &GpuMatrix, skip: usize, n: usize, to_bf16: bool) -> Result<Vec<f32>> {
        let g = &self.gpu;
        if skip + n > w.out * w.inp || (matches!(w.w, GpuWeights::Q8 { .. }) && skip % 32 != 0) {
            return Err(Error::Shape(format!("weights {skip}..{} of a {}×{} matrix", skip + n, w.out, w.inp)));
        }
        let (p, sp) = w.pointers(g);
        let ptrs = match w.w {
            GpuWeights::Q8 { .. } => vec![p + skip as u64, sp + (2 * (skip / 32)) as u64],
            _ => vec![p + (2 * skip) as u64],
        };
        match (&w.w, to_bf16) {
            (GpuWeights::Q8 { .. }, true) => {
                let mut e = g.alloc::<u16>(n)?;
                g.poison(&mut e)?;
                self.expand(&self.expand_q8_bf16, &ptrs, n, g.ptr(&e))?;
                Ok(g.download(&e)?.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect())
            }
            (GpuWeights::Q8 { .. }, false) | (GpuWeights::Bf16(_), false) => {
                let kernel = if matches!(w.w, GpuWeights::Q8 { .. }) { &self.expand_q8_f32 } else { &self.expand_bf16_f32 };
                let mut e = g.alloc::<f32>(n)?;
                g.poison(&mut e)?;
                self.expand(kernel, &ptrs, n, g.ptr(&e))?;
                g.download(&e)
            }
            _ => Err(Error::Shape("no expansion of these weights to that operand".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles cover each expert's rows in order, at most GEMV_MAX_ROWS a tile, and skip experts
    /// without rows.
    #[test]
    fn expert_tiles_cover_each_experts_rows_in_order() {
        // Expert 0: rows 0..3; 1: none; 2: rows 3..20 (17 rows: 8, 8, 1); 3: none; 4: rows 20..28.
        let tiles = expert_tiles(&[0, 3, 3, 20, 20, 28]).unwrap();
        assert_eq!(tiles, vec![[0, 0, 3], [2, 3, 8], [2, 11, 8], [2, 19, 1], [4, 20, 8]]);
        assert!(expert_tiles(&[0, 0, 0]).unwrap().is_empty());
        assert!(expert_tiles(&[0]).unwrap().is_empty());
        // Every row once, each tile within its expert's range.
        let start = [0usize, 9, 9, 40, 41];
        let tiles = expert_tiles(&start).unwrap();
        let mut next = 0;
        for [e, r0, n] in tiles {
            let (e, r0, n) = (e as usize, r0 as usize, n as usize);
            assert_eq!(r0, next);
            assert!((1..=GEMV_MAX_ROWS).contains(&n) && start[e] <= r0 && r0 + n <= start[e + 1]);
            next = r0 + n;
        }
        assert_eq!(next, 41);
    }

    /// The host's count of features per warp (block counts, output ranges) must be the one each
    /// kernel is compiled with: a warp covering more features than the host counted writes past
    /// its output.
    #[test]
    fn host_features_per_warp_match_the_compiled_kernels() {
        let src = include_str!("gemv.cu");
        let mut seen = 0;
        for line in src.lines().filter(|l| l.starts_with("TERN_GEMV_KERNELS(")) {
            let args: Vec<&str> = line["TERN_GEMV_KERNELS(".len()..].trim_end_matches(')').split(',').map(str::trim).collect();
            let (suffix, r, opw, opw_gated): (&str, usize, usize, usize) =
                (args[0], args[1].parse().unwrap(), args[2].parse().unwrap(), args[3].parse().unwrap());
            let narrow = suffix.ends_with('n');
            // The row counts that take this R (GemvKernels::get).
            let rows: Vec<usize> = (1..=GEMV_MAX_ROWS).filter(|&n| n.next_power_of_two() == r).collect();
            for n in rows {
                for output in [GemvOutput::Plain, GemvOutput::Residual, GemvOutput::AddNorm] {
                    assert_eq!(gemv_outputs_per_warp(n, output, narrow), if narrow { 1 } else { opw }, "{suffix} {output:?} {n} rows");
                }
                for output in [GemvOutput::Silu, GemvOutput::GeluTanh] {
                    assert_eq!(gemv_outputs_per_warp(n, output, narrow), if narrow { 1 } else { opw_gated }, "{suffix} {output:?} {n} rows");
                }
                seen += 1;
            }
        }
        assert!(seen >= 8 + 7, "every row count of both forms checked ({seen})");
    }

    /// GemvParts mirrors tern_gemv_parts (4 parts): 12 addresses, 4 + 5 + 2 ints, then the norm
    /// operands from byte 144 (norm_w, norm_out, counter, eps, stream at 176, next_w, post),
    /// then the conv's from byte 200 (conv_w, conv_at, conv_part), then up and up_ld at 224,
    /// 240 bytes in all, as the C compiler lays the kernel's struct out.
    #[test]
    fn gemv_parts_keep_the_kernels_layout() {
        assert_eq!(std::mem::offset_of!(GemvParts, ks), 136);
        assert_eq!(std::mem::offset_of!(GemvParts, tail), 144);
        assert_eq!(std::mem::offset_of!(NormTail, eps), 24);
        assert_eq!(std::mem::offset_of!(NormTail, stream), 32);
        assert_eq!(std::mem::offset_of!(NormTail, post), 48);
        assert_eq!(std::mem::offset_of!(GemvParts, conv), 200);
        assert_eq!(std::mem::offset_of!(ConvTail, part), 16);
        assert_eq!(std::mem::offset_of!(GemvParts, up), 224);
        assert_eq!(std::mem::offset_of!(GemvParts, early), 240);
        assert_eq!(std::mem::offset_of!(GemvParts, in_eps), 244);
        assert_eq!(std::mem::offset_of!(GemvParts, in_h), 248);
        assert_eq!(std::mem::offset_of!(GemvParts, in_a), 264);
        assert_eq!(std::mem::size_of::<GemvParts>(), 272);
        let code = include_str!("gemv.cu");
        assert!(code.contains("static_assert(sizeof(tern_gemv_parts) == 272,"));
    }

    #[test]
    fn gemm_q8_splits_fill_the_multiprocessors_with_whole_stages() {
        // Qwen3.5-0.8B's FFN down projection (1024 x 3584) for 64 rows on 132 multiprocessors:
        // 16 blocks want 17 splits, bounded by 28 stages of k in twos.
        assert_eq!(gemm_q8_splits(1024, 64, 3584, 132), 14);
        // Its gate|up (7168 x 1024): 112 blocks, 3 splits; for 256 rows 448 blocks, none.
        assert_eq!(gemm_q8_splits(7168, 64, 1024, 132), 3);
        assert_eq!(gemm_q8_splits(7168, 256, 1024, 132), 1);
        // One stage of k cannot split; at most 16 parts.
        assert_eq!(gemm_q8_splits(64, 9, 96, 132), 1);
        assert_eq!(gemm_q8_splits(64, 9, 1 << 16, 132), 16);
        let code = include_str!("gemm_q8.cu");
        let (bm, bn, kc, stages) = GEMM_Q8_TILE;
        for (name, v) in [("BM", bm), ("BN", bn), ("KC", kc), ("STAGES", stages)] {
            assert!(code.contains(&format!("#define TERN_GEMM_Q8_{name} {v}")), "gemm_q8.cu's TERN_GEMM_Q8_{name} is not {v}");
        }
        assert!(code.contains("#define TERN_GEMM_Q8_LD (TERN_GEMM_Q8_KC + 32)"), "the staged row's padding");
    }

    #[test]
    fn split_depends_on_the_matrix_and_keeps_two_steps_a_warp() {
        // A Qwen3.5-0.8B output projection on 132 multiprocessors: 4 warps a feature.
        assert_eq!(gemv_split(1024, 2048, 132), 4);
        // The early steps as gemv.cu has them, by weight type.
        let code = include_str!("gemv.cu");
        for (i, name) in ["TernWeightsF32", "TernWeightsBf16", "TernWeightsQ8"].iter().enumerate() {
            let body = &code[code.find(&format!("struct {name} {{")).unwrap_or_else(|| panic!("{name} not in gemv.cu"))..];
            let want = format!("EARLY_STEPS = {};", GEMV_EARLY_STEPS[i]);
            assert!(body[..body.find("};").unwrap()].contains(&want), "{name}: gemv.cu's EARLY_STEPS is not GEMV_EARLY_STEPS[{i}]");
        }
        // Bounded to fill the early requests: Qwen3.5-0.8B's products in bf16.
        assert_eq!(gemv_split_filling_early(1024, 4), 1);
        assert_eq!(gemv_split_filling_early(2048, 4), 2);
        assert_eq!(gemv_split_filling_early(3584, 4), 4);
        assert_eq!(gemv_split_filling_early(1 << 16, 2), GEMV_WARPS);
        assert_eq!(gemv_split(1024, 3584, 132), 4);
        // Each warp keeps two steps: a 1024-weight row splits in 2, not 4.
        assert_eq!(gemv_split(64, 1024, 132), 2);
        // Wide matrices and short rows are not split.
        assert_eq!(gemv_split(248_320, 1024, 132), 1);
        assert_eq!(gemv_split(1024, 768, 132), 1);
        assert_eq!(gemv_split(100, 1 << 16, 132), GEMV_WARPS);
    }
}
