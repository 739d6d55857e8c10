//! The CUDA backend of the op set: [`Ops`] over device buffers, each op the launcher of its
//! family's CUDA form (`src/kernels/<family>/cuda.rs`, source beside it). Everything is queued
//! on the GPU's one stream; only [`Ops::to_host`] waits.
//!
//! Two precisions ([`Precision`]): f32 (the same maths as the CPU, plain SGEMM) and bf16
//! (weights stored as bf16, GEMM inputs rounded to bf16, tensor-core GEMMs with f32
//! accumulation; activations, norms, attention and the residual stay f32). fp16 is refused:
//! EmbeddingGemma's activations overflow half precision.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::cuda::{driver_err, CudaSlice, Gpu, KernelSource};
use crate::error::{Error, Result};
use crate::formats::Tensor;
use crate::kernels::activation::cuda::ActivationCuda;
use crate::kernels::attention::cuda::{AttentionCuda, GpuAttentionBatch};
use crate::kernels::attention::AttentionShape;
use crate::kernels::backend::{matrix_dims, HeadOps, Ops, View};
use crate::kernels::embedding::cuda::{EmbeddingCuda, GpuIds};
use crate::kernels::matmul::cuda::{Blas, GpuMatrix, GpuWeights};
use crate::kernels::norm::cuda::{NormCuda, NormOut};
use crate::kernels::pool::cuda::PoolCuda;
use crate::kernels::rope::cuda::{GpuHeadPrep, GpuRope, RopeCuda};
use crate::kernels::rope::RopeTable;
use crate::kernels::Segment;

/// The encoder-side CUDA translation units (the gated-delta family lists its own).
pub const SOURCES: &[KernelSource] = &[
    crate::kernels::norm::cuda::SOURCE,
    crate::kernels::activation::cuda::SOURCE,
    crate::kernels::rope::cuda::SOURCE,
    crate::kernels::attention::cuda::SOURCE,
    crate::kernels::attention::cuda::SOURCE_TC,
    crate::kernels::pool::cuda::SOURCE,
    crate::kernels::embedding::cuda::SOURCE,
    crate::kernels::matmul::cuda::SOURCE,
];

/// Batches of at most this many tokens run as CUDA graphs: at these sizes a forward pass is a
/// few hundred launches of microsecond kernels, and replaying a recorded graph removes the
/// per-launch host overhead that would otherwise dominate (a short query's latency).
pub const GRAPH_MAX_TOKENS: usize = 512;
/// Recorded graphs kept per model (distinct batch shapes); the cache is cleared when full.
const GRAPH_CACHE: usize = 64;

/// A recorded forward pass: its batch (whose id buffer a replay reads) and output buffer.
struct Recorded {
    batch: CudaBatch,
    graph: cudarc::driver::CudaGraph,
    out: CudaSlice<f32>,
}

// SAFETY: a Recorded is only touched under CudaOps::graphs' lock, by one thread at a time; the
// graph handle has no thread affinity (the driver API takes any thread bound to the context).
unsafe impl Send for Recorded {}

/// Arithmetic of the GEMMs on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 operands, f32 arithmetic: the reference maths.
    #[default]
    F32,
    /// bf16 weights and GEMM inputs on tensor cores, f32 accumulation and activations.
    Bf16,
}

impl FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "f16" | "fp16" | "float16" | "half" => Err(Error::Input(
                "dtype fp16 is refused: EmbeddingGemma's activations overflow half precision (use bf16 or f32)".into(),
            )),
            _ => Err(Error::Input(format!("dtype `{s}`: expected f32 or bf16"))),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// An embedding table on the device (always f32: a lookup, not a product).
pub struct GpuTable {
    data: CudaSlice<f32>,
    width: usize,
}

/// A packed batch on the device: the attention tiles, segment bounds and row positions.
pub struct CudaBatch {
    ids: GpuIds,
    att: GpuAttentionBatch,
    positions: CudaSlice<u32>,
    max_position: usize,
}

pub struct CudaOps {
    gpu: Arc<Gpu>,
    precision: Precision,
    blas: Blas,
    norm: NormCuda,
    activation: ActivationCuda,
    rope: RopeCuda,
    attention: AttentionCuda,
    pool: PoolCuda,
    embedding: EmbeddingCuda,
    /// Bytes of weights uploaded so far.
    weight_bytes: AtomicUsize,
    /// cuBLAS handles are not thread-safe and forward passes share the stream: one at a time.
    exclusive: Mutex<()>,
    /// Recorded forward passes by sequence lengths (Err: recording failed, run plainly).
    graphs: Mutex<HashMap<Vec<usize>, std::result::Result<Recorded, String>>>,
}

impl CudaOps {
    /// Compiles (through the cache) and loads every encoder kernel on `gpu`.
    pub fn new(gpu: Arc<Gpu>, precision: Precision) -> Result<Self> {
        Ok(CudaOps {
            blas: Blas::new(gpu.clone())?,
            norm: NormCuda::new(gpu.clone())?,
            activation: ActivationCuda::new(gpu.clone())?,
            rope: RopeCuda::new(gpu.clone())?,
            attention: AttentionCuda::new(gpu.clone())?,
            pool: PoolCuda::new(gpu.clone())?,
            embedding: EmbeddingCuda::new(gpu.clone())?,
            gpu,
            precision,
            weight_bytes: AtomicUsize::new(0),
            exclusive: Mutex::new(()),
            graphs: Mutex::new(HashMap::new()),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Device bytes held by the weights uploaded through this backend.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(Ordering::Relaxed)
    }

    /// `cuda:N <name> (<arch>), <precision>`.
    pub fn describe(&self) -> String {
        format!("cuda:{} {} ({}), {}", self.gpu.ordinal(), self.gpu.name(), self.gpu.arch(), self.precision)
    }

    /// FLOP/s of this backend's GEMM (its precision) on `[m × k]·[k × n]`, median of timed
    /// runs: the roofline that benchmarks report their fraction of.
    pub fn measure_gemm_rate(&self, m: usize, n: usize, k: usize) -> Result<f64> {
        let w = self.blas.matrix(&vec![0.01f32; n * k], n, k, self.precision == Precision::Bf16)?;
        let x = self.gpu.upload(&vec![0.5f32; m * k])?;
        let x16 = self.gemm_input(&x, &w)?;
        let mut y = self.gpu.alloc::<f32>(m * n)?;
        let (start, end) = (self.gpu.event()?, self.gpu.event()?);
        let mut times = Vec::new();
        for rep in 0..12 {
            start.record(self.gpu.stream()).map_err(crate::cuda::driver_err("recording an event"))?;
            self.blas.linear(Some(&x), x16.as_ref(), m, &w, &mut y)?;
            end.record(self.gpu.stream()).map_err(crate::cuda::driver_err("recording an event"))?;
            end.synchronize().map_err(crate::cuda::driver_err("waiting for an event"))?;
            let ms = start.elapsed_ms(&end).map_err(crate::cuda::driver_err("timing"))? as f64;
            if rep >= 2 {
                times.push(ms);
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(2.0 * (m * n * k) as f64 / (times[times.len() / 2] * 1e-3))
    }

    /// Forward passes recorded as CUDA graphs so far, and the recording failures (each with
    /// its error).
    pub fn graph_stats(&self) -> (usize, Vec<String>) {
        let graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let recorded = graphs.values().filter(|g| g.is_ok()).count();
        (recorded, graphs.values().filter_map(|g| g.as_ref().err().cloned()).collect())
    }

    fn count(&self, bytes: usize) {
        self.weight_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn upload_f32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.count(4 * v.len());
        self.gpu.upload(v)
    }

    /// A bf16 copy of `x` when the weights are bf16 (the GEMM's operand), else None.
    fn gemm_input(&self, x: &CudaSlice<f32>, w: &GpuMatrix) -> Result<Option<CudaSlice<u16>>> {
        match w.w {
            GpuWeights::F32(_) => Ok(None),
            GpuWeights::Bf16(_) => {
                let mut x16 = self.gpu.alloc::<u16>(x.len())?;
                self.blas.to_bf16(x, &mut x16)?;
                Ok(Some(x16))
            }
        }
    }

    fn out(f32: &mut CudaSlice<f32>) -> NormOut<'_> {
        NormOut { f32: Some(f32), bf16: None }
    }
}

impl Ops for CudaOps {
    type Buf = CudaSlice<f32>;
    type Mat = GpuMatrix;
    type Vector = CudaSlice<f32>;
    type Table = GpuTable;
    type Rope = GpuRope;
    type Batch = CudaBatch;

    fn matrix(&self, w: Tensor) -> Result<GpuMatrix> {
        let (out, inp) = matrix_dims(&w)?;
        let m = self.blas.matrix(w.data(), out, inp, self.precision == Precision::Bf16)?;
        self.count(m.bytes());
        Ok(m)
    }

    fn vector(&self, v: Vec<f32>) -> Result<CudaSlice<f32>> {
        self.upload_f32(&v)
    }

    fn table(&self, t: Tensor) -> Result<GpuTable> {
        let (_, width) = matrix_dims(&t)?;
        Ok(GpuTable { data: self.upload_f32(t.data())?, width })
    }

    fn rope(&self, t: RopeTable) -> Result<GpuRope> {
        self.count(8 * t.cos().len());
        GpuRope::new(&self.gpu, &t)
    }

    fn batch(&self, segments: &[Segment], ids: &[u32]) -> Result<CudaBatch> {
        let att = GpuAttentionBatch::new(&self.gpu, segments)?;
        if ids.len() != att.rows {
            return Err(Error::Shape(format!("batch: {} ids for segments covering {} rows", ids.len(), att.rows)));
        }
        let positions: Vec<u32> = segments.iter().flat_map(|s| 0..s.len as u32).collect();
        let max_position = segments.iter().map(|s| s.len.saturating_sub(1)).max().unwrap_or(0);
        Ok(CudaBatch { ids: GpuIds::new(&self.gpu, ids)?, positions: self.gpu.upload(&positions)?, att, max_position })
    }

    fn segments<'b>(&self, batch: &'b CudaBatch) -> &'b [Segment] {
        &batch.att.segments
    }

    fn run_batch(&self, segments: &[Segment], ids: &[u32], f: &dyn Fn(&CudaBatch) -> Result<CudaSlice<f32>>) -> Result<Vec<f32>> {
        let plain = || -> Result<Vec<f32>> {
            let batch = self.batch(segments, ids)?;
            let y = f(&batch)?;
            self.to_host(&y)
        };
        if ids.len() > GRAPH_MAX_TOKENS || std::env::var_os("TERN_NO_CUDA_GRAPHS").is_some() {
            return plain();
        }
        let key: Vec<usize> = segments.iter().map(|s| s.len).collect();
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        match graphs.get_mut(&key) {
            Some(Ok(r)) => {
                r.batch.ids.write(&self.gpu, ids)?;
                r.graph.launch().map_err(driver_err("launching a recorded forward pass"))?;
                return self.to_host(&r.out);
            }
            Some(Err(_)) => return plain(),
            None => {}
        }
        // First batch of this shape: run it plainly (which also loads every kernel and lets
        // cuBLAS set up its workspace), then record the same work for the next one.
        let batch = self.batch(segments, ids)?;
        let y = f(&batch)?;
        let host = self.to_host(&y)?;
        let mut out = self.gpu.alloc::<f32>(y.len())?;
        drop(y);
        if graphs.len() >= GRAPH_CACHE {
            graphs.clear();
        }
        let stream = self.gpu.stream();
        let recorded = stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_err("starting a graph capture"))
            .and_then(|()| {
                // Whatever happens inside, the capture must end, or the stream stays in it.
                let queued = f(&batch).and_then(|y| self.gpu.copy(&y, &mut out));
                let graph = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)).map_err(driver_err("ending a graph capture"));
                queued.and(graph)
            });
        let entry = match recorded {
            Ok(Some(graph)) => Ok(Recorded { batch, graph, out }),
            Ok(None) => Err("the capture recorded no graph".to_string()),
            Err(e) => Err(e.to_string()),
        };
        graphs.insert(key, entry);
        Ok(host)
    }

    fn serialize(&self) -> Option<MutexGuard<'_, ()>> {
        Some(self.exclusive.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn embed(&self, table: &GpuTable, batch: &CudaBatch, scale: f32) -> Result<CudaSlice<f32>> {
        let mut out = self.gpu.alloc::<f32>(batch.ids.len * table.width)?;
        self.embedding.embed_lookup(&table.data, table.width, &batch.ids, scale, &mut out)?;
        Ok(out)
    }

    fn linear(&self, x: &CudaSlice<f32>, rows: usize, w: &GpuMatrix, bias: Option<&CudaSlice<f32>>) -> Result<CudaSlice<f32>> {
        let x16 = self.gemm_input(x, w)?;
        let mut y = self.gpu.alloc::<f32>(rows * w.out)?;
        self.blas.linear(Some(x), x16.as_ref(), rows, w, &mut y)?;
        if let Some(b) = bias {
            self.blas.add_bias(&mut y, b)?;
        }
        Ok(y)
    }

    fn rms_norm(&self, x: &CudaSlice<f32>, d: usize, w: Option<&CudaSlice<f32>>, pre: f32, eps: f32) -> Result<CudaSlice<f32>> {
        let mut y = self.gpu.alloc::<f32>(x.len())?;
        self.norm.rms_norm(x, d, w, pre, eps, Self::out(&mut y))?;
        Ok(y)
    }

    fn add_norm(&self, h: &mut CudaSlice<f32>, y: &CudaSlice<f32>, w: &CudaSlice<f32>, post: f32, d: usize, eps: f32) -> Result<()> {
        self.norm.add_norm(h, y, w, post, d, eps, None)
    }

    fn add_norm_next(
        &self,
        h: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        post: f32,
        d: usize,
        eps: f32,
        next: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.norm.add_norm(h, y, w, post, d, eps, Some((next, Self::out(out))))
    }

    fn gelu_tanh_mul(&self, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize) -> Result<CudaSlice<f32>> {
        let mut out = self.gpu.alloc::<f32>(rows * width)?;
        self.activation.gelu_tanh_mul(g, u, rows, width, Self::out(&mut out))?;
        Ok(out)
    }

    fn head_prep(&self, x: &mut CudaSlice<f32>, offset: usize, stride: usize, batch: &CudaBatch, prep: &HeadOps<Self>) -> Result<()> {
        let p = GpuHeadPrep { heads: prep.heads, hd: prep.hd, norm: prep.norm, eps: prep.eps, rope: prep.rope };
        self.rope.head_prep(x, offset, stride, batch.att.rows, &batch.positions, batch.max_position, &p)
    }

    fn attention(
        &self,
        q: View<CudaSlice<f32>>,
        k: View<CudaSlice<f32>>,
        v: View<CudaSlice<f32>>,
        batch: &CudaBatch,
        shape: &AttentionShape,
    ) -> Result<CudaSlice<f32>> {
        let mut out = self.gpu.alloc::<f32>(batch.att.rows * shape.q_heads * shape.hd)?;
        match self.precision {
            Precision::F32 => self.attention.attention(q, k, v, &batch.att, shape, Self::out(&mut out))?,
            Precision::Bf16 => self.attention.attention_bf16(q, k, v, &batch.att, shape, Self::out(&mut out))?,
        }
        Ok(out)
    }

    fn mean_pool(&self, h: &CudaSlice<f32>, d: usize, batch: &CudaBatch) -> Result<CudaSlice<f32>> {
        let mut out = self.gpu.alloc::<f32>(batch.att.segments.len() * d)?;
        self.pool.mean_pool(h, d, &batch.att, &mut out)?;
        Ok(out)
    }

    fn to_host(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.gpu.download(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_and_fp16_is_refused_with_the_reason() {
        assert_eq!("f32".parse::<Precision>().unwrap(), Precision::F32);
        assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::Bf16);
        for half in ["fp16", "f16", "float16", "half"] {
            match half.parse::<Precision>() {
                Err(Error::Input(m)) => assert!(m.contains("overflow"), "{m}"),
                other => panic!("{half}: expected a refusal, got {other:?}"),
            }
        }
        assert!("int8".parse::<Precision>().is_err());
    }
}
